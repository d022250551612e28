"""Tree ops refuse inputs that do not fit their documented shapes and dtypes with a ValueError that
names the problem, instead of broadcasting them into another computation or failing deep inside a
kernel (every backend: the checks run before the dispatch)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from harts_hf.forest import RolloutForest
from harts_hf.ops import (
    TreeBatch,
    tree_attention,
    tree_causal_conv1d,
    tree_gated_delta_rule,
    tree_gla,
    tree_kda,
    tree_mamba2_ssd,
    tree_simple_gla,
)
from harts_hf.ops.rounds import rounds_of

FOREST = RolloutForest.from_sequences([[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 9], [5, 6]])
BATCH = TreeBatch.from_forest(FOREST)
N, H, K, V = FOREST.num_compact_tokens, 2, 4, 3
gen = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(N, H, d, generator=gen) for d in (K, K, V))
g_head, g_channel, beta = -torch.rand(N, H, generator=gen), -torch.rand(N, H, K, generator=gen), torch.rand(N, H)
gdn = lambda *a, **kw: tree_gated_delta_rule(*a, BATCH, chunk_size=4, **kw)
x, dt, Bm = torch.randn(N, 4, 3), torch.randn(N, 4), torch.randn(N, 2, 5)

CASES = {
    "q heads do not divide v heads": (lambda: gdn(torch.randn(N, 3, K), k, v, g_head, beta), "H a multiple of Hq"),
    "q and k key dims differ": (lambda: gdn(torch.randn(N, H, K + 1), k, v, g_head, beta), "H a multiple of Hq"),
    "q without a head dim": (lambda: gdn(q[:, 0], k, v, g_head, beta), "H a multiple of Hq"),
    "v without a head dim": (lambda: gdn(q[:, :1], k[:, :1], v[:, 0], g_head, beta), "H a multiple of Hq"),
    "integer gate": (lambda: gdn(q, k, v, (g_head * 3).long(), beta), "g must be floating point"),
    "bool gate": (lambda: tree_gla(q, k, v, g_channel < -0.5, BATCH, chunk_size=4), "g must be floating point"),
    "GDN per-channel gate": (lambda: gdn(q, k, v, g_channel, beta), "g must be \\[N, 2\\]"),
    "GDN gate without heads": (lambda: gdn(q, k, v, g_head[:, 0], beta), "g must be \\[N, 2\\]"),
    "beta with a channel dim": (lambda: gdn(q, k, v, g_head, beta[..., None]), "beta must be \\[N, 2\\]"),
    "KDA per-head gate": (lambda: tree_kda(q, k, v, g_head, beta, BATCH, chunk_size=4), "g must be \\[N, 2, 4\\]"),
    "GLA per-head gate": (lambda: tree_gla(q, k, v, g_head, BATCH, chunk_size=4), "g must be \\[N, 2, 4\\]"),
    "simple GLA per-channel gate": (lambda: tree_simple_gla(q, k, v, g_channel, BATCH), "g must be \\[N, 2\\]"),
    "g_gamma of another head count": (
        lambda: tree_simple_gla(q, k, v, None, BATCH, g_gamma=-torch.ones(H + 1)),
        "g_gamma must be \\[2\\]",
    ),
    "Mamba2 B and C state sizes differ": (
        lambda: tree_mamba2_ssd(x, dt, -torch.rand(4), Bm, torch.randn(N, 2, 6), None, BATCH, chunk_size=4),
        "H a multiple of Hq",
    ),
    "Mamba2 A of another head count": (
        lambda: tree_mamba2_ssd(x, dt, -torch.rand(3), Bm, Bm, None, BATCH, chunk_size=4),
        "one value per head",
    ),
    "attention dtypes differ": (lambda: tree_attention(q, k.half(), v.half(), BATCH, scale=0.5), "share a dtype"),
    "attention without a head dim": (
        lambda: tree_attention(q[:, 0], k[:, 0], v[:, 0], BATCH, scale=0.5),
        "\\[N, heads, head_dim\\]",
    ),
    "conv of width 0": (lambda: tree_causal_conv1d(torch.randn(N, 6), torch.randn(6, 0), None, BATCH), "W >= 1"),
    "conv unknown activation": (
        lambda: tree_causal_conv1d(torch.randn(N, 6), torch.randn(6, 4), None, BATCH, activation="swishy"),
        "unknown activation 'swishy'",
    ),
}


@pytest.mark.parametrize("call, message", list(CASES.values()), ids=list(CASES))
def test_refused_with_a_clear_error(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_piece_context_must_match_the_piece_inputs():
    """A piece's context inputs carry the same per-token shape as its own (here v has V + 1 columns)."""
    piece = TreeBatch.from_forest(FOREST, tokens=np.array([3, 4, 5, 6]))
    n, nc = piece.num_tokens, rounds_of(piece, 2).context_replay.numel()  # the replayed context tokens
    context = {"k": k[:nc], "v": torch.randn(nc, H, V + 1), "g": g_head[:nc], "beta": beta[:nc]}
    with pytest.raises(ValueError, match="context v is"):
        tree_gated_delta_rule(
            q[:n],
            k[:n],
            v[:n],
            g_head[:n],
            beta[:n],
            piece,
            chunk_size=2,
            context=context,
            initial_states=torch.zeros(1, H, K, V),
        )


def test_size_one_dims_and_shared_heads_broadcast():
    """Size-1 gate / beta dims and q, k with fewer heads than v (each repeated to v's heads, as Jamba
    shares one query head) are the documented broadcast, not an error: same result as expanded."""
    expanded = gdn(q[:, :1].expand(N, H, K), k, v, g_head[:, :1].expand(N, H), beta[:, :1].expand(N, H))[0]
    torch.testing.assert_close(gdn(q[:, :1], k, v, g_head[:, :1], beta[:, :1])[0], expanded, rtol=0, atol=0)

"""Tests that run Triton kernels in Triton's CPU interpreter; ``test_ops_fla_interpreter.py`` runs
this file in a subprocess (TRITON_INTERPRET must be set before triton is imported, and the rest
of the suite must not see triton). Tiny shapes: the interpreter runs kernels in numpy."""

from __future__ import annotations

import os
from itertools import pairwise

os.environ["TRITON_INTERPRET"] = "1"

import numpy as np
import pytest
import torch
from chunk_scan_cases import assert_close
from fla_naive_segments import naive_segments
from trees import NASTY_TREES
from triton.runtime import autotuner

from harts_hf.forest import RolloutForest
from harts_hf.ops import backends, tree_gated_delta_rule
from harts_hf.ops.fla.delta_state_grad import delta_state_grad
from harts_hf.ops.fla.public_ops import SEGMENT_OPS
from harts_hf.ops.gated_delta import tree_gated_delta_rule_torch
from harts_hf.ops.tree_batch import TreeBatch

# fla's kernels autotune over several configs; the interpreter cannot time them: take the first.
autotuner.Autotuner.do_bench = property(lambda self: lambda kernel_call, quantiles: [0.0, 0.0, 0.0])

H, K, V, C = 2, 16, 8, 16


def local_cumsum(g: torch.Tensor, cu: list[int]) -> torch.Tensor:
    """Chunk-local cumulative sum of g along tokens, restarting at every chunk of every sequence."""
    out = g.clone()
    for a, b in pairwise(cu):
        for s in range(a, b, C):
            out[s : min(s + C, b)] = g[s : min(s + C, b)].cumsum(0)
    return out


def autograd_oracle(q, k, w, g, u, do, dv, dht, ext, cu, scale):
    """The delta-rule chunk recurrence run forward in PyTorch; autograd gives the gradients of
    L = sum <do, q-part of o> + <dv, v_new> + <dht, h_end> + sum <ext_c, h_c> w.r.t. every chunk's
    end state, every v_new and every initial state (what the kernel returns)."""
    per_channel = g.dim() == 3
    h0 = torch.zeros(len(cu) - 1, H, K, V, requires_grad=True)
    ends, vnews, loss, row = [], [], 0.0, 0
    for n, (a, b) in enumerate(pairwise(cu)):
        h = h0[n]
        for s in range(a, b, C):
            sl = slice(s, min(s + C, b))
            gc = g[sl]
            gk = (gc[-1] - gc) if per_channel else (gc[-1] - gc)[..., None]
            gq = gc if per_channel else gc[..., None]
            decay = gc[-1].exp()[..., None] if per_channel else gc[-1].exp()[:, None, None]
            loss = loss + (ext[row] * h).sum()
            vnew = u[sl].transpose(0, 1) - w[sl].transpose(0, 1) @ h  # [H, t, V]
            vnew.retain_grad()
            o = (q[sl] * gq.exp() * scale).transpose(0, 1) @ h
            loss = loss + (do[sl].transpose(0, 1) * o).sum() + (dv[sl].transpose(0, 1) * vnew).sum()
            h = decay * h + (k[sl] * gk.exp()).transpose(0, 1).transpose(1, 2) @ vnew
            h.retain_grad()
            ends.append(h)
            vnews.append(vnew)
            row += 1
        loss = loss + (dht[n] * h).sum()
    loss.backward()
    dh = torch.stack([e.grad for e in ends])
    dv2 = torch.cat([x.grad.transpose(0, 1) for x in vnews])
    return dh, dv2, h0.grad


@pytest.mark.parametrize("per_channel", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("external", [False, True], ids=["end_only", "interior"])
def test_delta_state_grad_matches_autograd(per_channel: bool, external: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    cu = [0, 40, 56, 57, 89]  # 3, 1, 1 and 2 chunks: a 1-token sequence, an exact multiple of C
    T, NT = cu[-1], 7
    q, k, w = (torch.randn(T, H, K, generator=gen) for _ in range(3))
    u, do, dv = (torch.randn(T, H, V, generator=gen) for _ in range(3))
    g = local_cumsum(-torch.rand(T, H, *([K] if per_channel else []), generator=gen) * 0.1, cu)
    dht = torch.randn(len(cu) - 1, H, K, V, generator=gen)
    ext = torch.randn(NT, H, K, V, generator=gen) if external else torch.zeros(NT, H, K, V)
    ref = autograd_oracle(q, k, w, g, u, do, dv, dht, ext, cu, 0.3)
    cu_t = torch.tensor(cu, dtype=torch.int32)
    got = delta_state_grad(q, k, w, g, do, dv, dht, ext if external else None, cu_t, scale=0.3, chunk_size=C)
    for name, r, o in zip(("dh", "dv2", "dh0"), ref, got):
        assert_close(name, r, o)


def test_registry_picks_fla_under_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """HARTS_BACKEND=fla runs the fla backend on CPU under the interpreter (naive segment kernels
    standing in for fla's state kernels, which the interpreter cannot run) and equals torch."""
    monkeypatch.setitem(SEGMENT_OPS, "gated_delta", naive_segments("gated_delta"))
    monkeypatch.setenv(backends.ENV, "fla")
    forest = RolloutForest.from_sequences(NASTY_TREES["branch_at_65"](np.random.default_rng(0)))
    batch = TreeBatch.from_forest(forest)
    gen = torch.Generator().manual_seed(1)
    n = forest.num_compact_tokens
    q, k = (torch.randn(n, 1, K, generator=gen) for _ in range(2))
    v, g, beta = (
        torch.randn(n, H, V, generator=gen),
        -torch.rand(n, H, generator=gen) * 0.05,
        torch.rand(n, H, generator=gen),
    )
    assert backends.implementation("gated_delta", q, k, v, g, beta, batch).__name__ == "tree_gated_delta_rule_fla"
    got = tree_gated_delta_rule(q, k, v, g, beta, batch, use_qk_l2norm=True)[0]
    ref = tree_gated_delta_rule_torch(q, k, v, g, beta, TreeBatch.from_forest(forest), use_qk_l2norm=True)[0]
    assert_close("o", ref, got)

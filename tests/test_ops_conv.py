"""Tree causal conv == transformers' ``causal_conv1d_fn`` run on every trajectory separately,
forward and gradients (x, weight, bias, context halo); pieces == the unsplit run."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers.models.qwen3_5 import modeling_qwen3_5
from trees import NASTY_TREES, nasty_tree_params

from harts_hf import RolloutForest
from harts_hf.ops.backends import implementation, registered
from harts_hf.ops.conv import conv_halo, tree_causal_conv1d, tree_causal_conv1d_torch
from harts_hf.ops.tree_batch import TreeBatch

# The undecorated torch function: on a machine without the causal-conv1d package the decorator
# only forwards to it (and warns); __wrapped__ pins the oracle to the reference either way.
oracle_conv = modeling_qwen3_5.causal_conv1d_fn.__wrapped__

D = 6
CASES = {  # width, activation, bias
    "w4_silu_bias": (4, "silu", True),
    "w7_nobias": (7, None, False),
    "w2_silu": (2, "silu", False),
}


def assert_close(name: str, ref: torch.Tensor, got: torch.Tensor, ratio: float = 1e-5) -> None:
    err = (ref - got).abs().max().item()
    scale = max(ref.abs().max().item(), 1e-12)
    assert err <= ratio * scale, f"{name}: max abs diff {err:.3g} > {ratio:g} * {scale:.3g}"


def _inputs(n: int, case: str):
    width, activation, has_bias = CASES[case]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, D, generator=g).requires_grad_()
    weight = torch.randn(D, width, generator=g).requires_grad_()
    bias = torch.randn(D, generator=g).requires_grad_() if has_bias else None
    return x, weight, bias, activation


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("build", nasty_tree_params())
def test_matches_trajectories(build, case):
    forest = RolloutForest.from_sequences(build(np.random.default_rng(0)))
    x, weight, bias, activation = _inputs(forest.num_compact_tokens, case)
    leaves = [t for t in (x, weight, bias) if t is not None]
    cot = torch.randn(forest.num_trajectory_tokens, D, generator=torch.Generator().manual_seed(1))

    out = tree_causal_conv1d(x, weight, bias, TreeBatch.from_forest(forest), activation=activation)
    got = torch.autograd.grad((out[forest.restore] * cot).sum(), leaves)

    loss = 0
    for i in range(forest.num_trajectories):
        idx = forest.trajectory_index(i)
        ref = oracle_conv(x[idx].T[None], weight, bias, activation)[0].T  # [L, D]
        assert_close(f"out[trajectory {i}]", ref, out[idx].detach())
        loss = loss + (ref * cot[forest.traj_offsets[i] : forest.traj_offsets[i + 1]]).sum()
    want = torch.autograd.grad(loss, leaves)
    for name, a, b in zip(("x", "weight", "bias"), want, got):
        assert_close(f"d{name}", a, b)


@pytest.mark.parametrize("build", nasty_tree_params())
def test_pieces_equal_unsplit(build):
    forest = RolloutForest.from_sequences(build(np.random.default_rng(0)))
    n = forest.num_compact_tokens
    x, weight, bias, activation = _inputs(n, "w4_silu_bias")
    cot = torch.randn(n, D, generator=torch.Generator().manual_seed(1))
    full = tree_causal_conv1d(x, weight, bias, TreeBatch.from_forest(forest), activation=activation)
    want = torch.autograd.grad((full * cot).sum(), (x, weight, bias))

    mid = forest.node_start[forest.num_nodes // 2]
    subtree = np.arange(mid, forest.subtree_end[mid])
    partitions = {
        "thirds": np.array_split(np.arange(n), 3),
        "strided": [np.arange(r, n, 3) for r in range(3)],
        "subtree": [p for p in (subtree, np.setdiff1d(np.arange(n), subtree)) if p.size],
    }
    for cut, pieces in partitions.items():
        loss = 0
        for tokens in pieces:
            batch = TreeBatch.from_forest(forest, tokens=tokens)
            ids = batch.global_index.numpy()
            own = ids[batch.num_context :]
            halo = ids[conv_halo(batch, weight.shape[1]).numpy()] if batch.num_context else ids[:0]
            assert set(halo) <= set(ids[: batch.num_context])
            context_x = x[halo] if halo.size else None
            out = tree_causal_conv1d(x[own], weight, bias, batch, activation=activation, context_x=context_x)
            assert_close(f"{cut}: out", full[own].detach(), out.detach())
            loss = loss + (out * cot[own]).sum()
        got = torch.autograd.grad(loss, (x, weight, bias))
        for name, a, b in zip(("x", "weight", "bias"), want, got):
            assert_close(f"{cut}: d{name}", a, b)


def test_dtype_follows_hf():
    """bf16 activations with an fp32 kernel: computed in fp32, returned in bf16, like the oracle."""
    forest = RolloutForest.from_sequences(NASTY_TREES["caterpillar"](np.random.default_rng(0)))
    x, weight, bias, activation = _inputs(forest.num_compact_tokens, "w4_silu_bias")
    low = x.detach().bfloat16()
    out = tree_causal_conv1d(low, weight, bias, TreeBatch.from_forest(forest), activation=activation)
    idx = forest.trajectory_index(0)
    ref = oracle_conv(low[idx].T[None], weight, bias, activation)[0].T
    assert out.dtype == ref.dtype == torch.bfloat16
    assert_close("bf16 out", ref.float(), out[idx].float(), ratio=1e-2)


def test_registered_and_dispatched(monkeypatch):
    monkeypatch.setenv("HARTS_BACKEND", "torch")
    forest = RolloutForest.from_sequences([[1, 2, 3], [1, 2, 4]])
    x, weight, bias, _ = _inputs(forest.num_compact_tokens, "w4_silu_bias")
    assert "torch" in registered("conv")
    assert implementation("conv", x, weight, bias, TreeBatch.from_forest(forest)) is tree_causal_conv1d_torch


def test_refuses_mismatched_context():
    forest = RolloutForest.from_sequences(NASTY_TREES["caterpillar"](np.random.default_rng(0)))
    batch = TreeBatch.from_forest(forest, tokens=np.arange(50, forest.num_compact_tokens))
    x, weight, bias, _ = _inputs(batch.num_tokens, "w4_silu_bias")
    with pytest.raises(ValueError, match="context"):
        tree_causal_conv1d(x, weight, bias, batch)
    with pytest.raises(ValueError, match="context_x"):
        tree_causal_conv1d(x, weight, bias, batch, context_x=x[: conv_halo(batch, weight.shape[1]).numel() - 1])


def test_bf16_weights_accumulate_in_fp32():
    """A bf16 model: forward and gradients stay within bf16 rounding of the fp32 computation."""
    forest = RolloutForest.from_sequences(NASTY_TREES["deep_chain"](np.random.default_rng(0)))
    batch = TreeBatch.from_forest(forest)
    x, weight, _, _ = _inputs(forest.num_compact_tokens, "w7_nobias")
    low = [t.detach().bfloat16().requires_grad_() for t in (x, weight)]
    out = tree_causal_conv1d(*low, None, batch)
    ref = tree_causal_conv1d(x, weight, None, batch)
    (out.float() * ref.detach()).sum().backward()
    (ref * ref.detach()).sum().backward()
    assert out.dtype == low[1].grad.dtype == torch.bfloat16
    assert_close("bf16 out", ref.detach(), out.detach().float(), ratio=2e-2)
    assert_close("bf16 dx", x.grad, low[0].grad.float(), ratio=2e-2)
    assert_close("bf16 dweight", weight.grad, low[1].grad.float(), ratio=2e-2)

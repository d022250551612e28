"""Ancestor attention == causal attention run on every trajectory separately (transformers' own
attention functions as the oracle), forward and every gradient; pieces == the unsplit run."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward as gemma2_eager
from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward as gpt_oss_eager
from trees import NASTY_TREES, nasty_tree_params

from harts_hf import RolloutForest
from harts_hf.ops.attention import tree_attention, tree_attention_torch
from harts_hf.ops.backends import implementation, registered
from harts_hf.ops.tree_batch import TreeBatch

HQ, HKV, D, DV = 4, 2, 8, 6
SCALE = D**-0.5
SOFTCAP = 1.5

# "default": the public entry point (128-query blocks); "small": 8-query blocks in groups of a
# few blocks, so the tiny trees span many blocks, buckets and groups.
LAYOUTS = {
    "default": tree_attention,
    "small": lambda *a, **kw: tree_attention_torch(*a, **kw, block_size=8, group_elements=4 * HQ * 8 * 16),
}


def assert_close(name: str, ref: torch.Tensor, got: torch.Tensor, ratio: float = 1e-5) -> None:
    err = (ref - got).abs().max().item()
    scale = max(ref.abs().max().item(), 1e-12)
    assert err <= ratio * scale, f"{name}: max abs diff {err:.3g} > {ratio:g} * {scale:.3g}"


def _inputs(n: int, seed: int = 0, sinks: bool = False):
    g = torch.Generator().manual_seed(seed)
    shapes = ((n, HQ, D), (n, HKV, D), (n, HKV, DV), (HQ,))
    q, k, v, s = (torch.randn(*shape, generator=g).requires_grad_() for shape in shapes)
    return q, k, v, s if sinks else None


def _oracle(variant: str, q, k, v, sinks) -> torch.Tensor:
    """transformers' attention on ONE trajectory: q [L, Hq, D], k/v [L, Hkv, D(v)] -> [L, Hq, Dv]."""
    module = SimpleNamespace(num_key_value_groups=HQ // HKV, training=False, is_causal=True, sinks=sinks)
    q, k, v = (x.transpose(0, 1)[None] for x in (q, k, v))  # [1, H, L, D]
    n = q.shape[2]
    causal = torch.full((n, n), torch.finfo(torch.float32).min).triu(1)[None, None]  # additive mask
    if variant == "plain":
        out, _ = sdpa_attention_forward(module, q, k, v, None, scaling=SCALE, is_causal=True)
    elif variant == "softcap":
        out, _ = gemma2_eager(module, q, k, v, causal, scaling=SCALE, softcap=SOFTCAP)
    else:
        out, _ = gpt_oss_eager(module, q, k, v, causal, scaling=SCALE)
    return out[0]


VARIANTS = {"plain": {}, "softcap": {"softcap": SOFTCAP}, "sinks": {}}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("build", nasty_tree_params())
def test_matches_trajectories(build, variant, layout):
    forest = RolloutForest.from_sequences(build(np.random.default_rng(0)))
    q, k, v, sinks = _inputs(forest.num_compact_tokens, sinks=variant == "sinks")
    leaves = [x for x in (q, k, v, sinks) if x is not None]
    cot = torch.randn(forest.num_trajectory_tokens, HQ, DV, generator=torch.Generator().manual_seed(1))

    out = LAYOUTS[layout](q, k, v, TreeBatch.from_forest(forest), scale=SCALE, sinks=sinks, **VARIANTS[variant])
    assert out.shape == (forest.num_compact_tokens, HQ, DV)
    got = torch.autograd.grad((out[forest.restore] * cot).sum(), leaves)

    loss = 0
    for i in range(forest.num_trajectories):
        idx = forest.trajectory_index(i)
        ref = _oracle(variant, q[idx], k[idx], v[idx], sinks)
        assert_close(f"out[trajectory {i}]", ref, out[idx].detach())
        loss = loss + (ref * cot[forest.traj_offsets[i] : forest.traj_offsets[i + 1]]).sum()
    want = torch.autograd.grad(loss, leaves)
    for name, a, b in zip("qkv" + "s", want, got):
        assert_close(f"d{name}", a, b)


def _partitions(forest: RolloutForest) -> dict[str, list[np.ndarray]]:
    """Ways to cut a forest into pieces that cover every compact token exactly once."""
    n = forest.num_compact_tokens
    mid = forest.node_start[forest.num_nodes // 2]
    subtree = np.arange(mid, forest.subtree_end[mid])
    rest = np.setdiff1d(np.arange(n), subtree)
    return {
        "thirds": np.array_split(np.arange(n), 3),
        "strided": [np.arange(r, n, 3) for r in range(3)],
        "subtree": [subtree] + ([rest] if rest.size else []),
    }


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("build", nasty_tree_params())
def test_pieces_equal_unsplit(build, layout):
    forest = RolloutForest.from_sequences(build(np.random.default_rng(0)))
    n = forest.num_compact_tokens
    q, k, v, sinks = _inputs(n, sinks=True)
    cot = torch.randn(n, HQ, DV, generator=torch.Generator().manual_seed(1))
    run = LAYOUTS[layout]
    kw = {"scale": SCALE, "sinks": sinks, "softcap": SOFTCAP}

    full = run(q, k, v, TreeBatch.from_forest(forest), **kw)
    want = torch.autograd.grad((full * cot).sum(), (q, k, v, sinks))
    for cut, pieces in _partitions(forest).items():
        loss = 0
        for tokens in pieces:
            batch = TreeBatch.from_forest(forest, tokens=tokens)
            ids = batch.global_index.numpy()
            ctx, own = ids[: batch.num_context], ids[batch.num_context :]
            context_kv = (k[ctx], v[ctx]) if ctx.size else None
            out = run(q[own], k[own], v[own], batch, context_kv=context_kv, **kw)
            assert_close(f"{cut}: out", full[own].detach(), out.detach())
            loss = loss + (out * cot[own]).sum()
        got = torch.autograd.grad(loss, (q, k, v, sinks))
        for name, a, b in zip("qkvs", want, got):
            assert_close(f"{cut}: d{name}", a, b)


def _small_case(dtype=torch.float64):
    """13 tokens: two roots, a branch, a strict prefix; 4-query blocks make 4 blocks."""
    forest = RolloutForest.from_sequences([[1, 2, 3, 4, 5, 6], [1, 2, 3, 7, 8], [1, 2], [9, 10, 11, 12]])
    g = torch.Generator().manual_seed(0)
    n = forest.num_compact_tokens
    q, k, v, s = (torch.randn(*shape, generator=g, dtype=dtype) for shape in ((n, 2, 3), (n, 1, 3), (n, 1, 2), (2,)))
    return TreeBatch.from_forest(forest), [x.requires_grad_() for x in (q, k, v, s)]


def test_gradcheck_softcap_sinks_dropout():
    """Backward == numerical derivative of forward, with softcap, sinks and dropout together."""
    batch, inputs = _small_case()

    def run(q, k, v, s):
        torch.manual_seed(0)  # the same dropout masks in every evaluation
        return tree_attention_torch(
            q, k, v, batch, scale=0.7, softcap=2.0, sinks=s, dropout=0.3, block_size=4, group_elements=64
        )

    assert torch.autograd.gradcheck(run, inputs)


def test_dropout_is_unbiased():
    """Dropout keeps the expected output: the mean over many masks approaches the dropout-free one."""
    batch, (q, k, v, s) = _small_case()
    kw = {"scale": 0.7, "sinks": s, "block_size": 4, "group_elements": 64}
    ref = tree_attention_torch(q, k, v, batch, **kw).detach()
    torch.manual_seed(0)
    runs = torch.stack([tree_attention_torch(q, k, v, batch, dropout=0.2, **kw).detach() for _ in range(500)])
    assert (runs[0] != ref).any() and (runs[0] != runs[1]).any()
    assert_close("mean over dropout masks", ref, runs.mean(0), ratio=0.1)


def test_bf16_keeps_dtype():
    batch, inputs = _small_case(torch.float32)
    low = [x.detach().bfloat16().requires_grad_() for x in inputs]
    out = tree_attention(*low[:3], batch, scale=0.7, sinks=low[3])
    out.float().sum().backward()
    assert out.dtype == torch.bfloat16 and all(x.grad.dtype == torch.bfloat16 for x in low)
    ref = tree_attention(*inputs[:3], batch, scale=0.7, sinks=inputs[3])
    assert_close("bf16 out", ref.detach(), out.detach().float(), ratio=3e-2)


def test_registered_and_dispatched(monkeypatch):
    monkeypatch.setenv("HARTS_BACKEND", "torch")
    batch, (q, k, v, _) = _small_case()
    assert "torch" in registered("attention")
    assert implementation("attention", q, k, v, batch, scale=1.0) is tree_attention_torch


def test_refuses_mismatched_context():
    forest = RolloutForest.from_sequences(NASTY_TREES["caterpillar"](np.random.default_rng(0)))
    batch = TreeBatch.from_forest(forest, tokens=np.arange(50, forest.num_compact_tokens))
    n, nc = batch.num_tokens, batch.num_context
    q, k, v, _ = _inputs(n)
    with pytest.raises(ValueError, match="context"):
        tree_attention(q, k, v, batch, scale=SCALE)
    with pytest.raises(ValueError, match="context"):
        tree_attention(q, k, v, batch, scale=SCALE, context_kv=(k[: nc - 1], v[: nc - 1]))


@pytest.mark.parametrize(
    "option, message",
    [
        pytest.param({"sliding_window": 0}, "sliding_window", id="window-0"),
        pytest.param({"softcap": 0.0}, "softcap", id="softcap-0"),
        pytest.param({"dropout": 1.0}, "dropout", id="dropout-1"),
    ],
)
def test_refuses_options_that_mean_nothing(option, message):
    batch, (q, k, v, _) = _small_case()
    with pytest.raises(ValueError, match=message):
        tree_attention(q, k, v, batch, scale=SCALE, **option)


MEMORY_PROBE = textwrap.dedent(
    """
    import resource, numpy as np, torch
    from harts_hf import RolloutForest
    from harts_hf.ops.attention import tree_attention
    from harts_hf.ops.tree_batch import TreeBatch
    rng = np.random.default_rng(0)
    trunk, seqs = [], []
    for _ in range(TURNS):
        trunk = trunk + rng.integers(0, 1 << 30, 700).tolist()
        seqs.append(trunk + rng.integers(0, 1 << 30, 100).tolist())
    forest = RolloutForest.from_sequences(seqs)
    n = forest.num_compact_tokens
    q, k, v = (torch.randn(n, 8, HEAD_DIM, requires_grad=True) for _ in range(3))
    cot = torch.randn(n, 8, HEAD_DIM)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    (tree_attention(q, k, v, TreeBatch.from_forest(forest), scale=0.1) * cot).sum().backward()
    print(n, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) * 1024)
    """
)


@pytest.mark.slow
def test_memory_is_not_quadratic():
    """An 8k-token caterpillar (8 heads x 32 dims, fp32) runs forward+backward in < 1 GiB extra
    peak RSS, where ONE dense [H, N, N] fp32 score tensor alone would take 1.9 GiB."""
    code = MEMORY_PROBE.replace("TURNS", "10").replace("HEAD_DIM", "32")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    n, extra = map(int, done.stdout.split())
    assert n == 8000
    assert extra < 2**30, f"peak RSS grew by {extra / 2**30:.2f} GiB"


def test_a_piece_under_a_long_context_computes_bounded_groups_of_scores():
    """A block whose keys exceed a group's scores runs them in chunks (online softmax): every group
    stays within ``group_elements`` at any context length, and the result is the unchunked one."""
    from harts_hf.ops.attention import _build_blocks, _groups

    forest = RolloutForest.from_sequences([list(range(300))])
    batch = TreeBatch.from_forest(forest, tokens=np.arange(280, 300))  # 20 own tokens, 280 context
    blocks = _build_blocks(batch, 8)
    sizes = [HQ * 8 * blk.numel() * keys.shape[1] for blk, chunks in _groups(blocks, HQ, 256) for keys in chunks]
    assert max(sizes) <= 256 and len(sizes) > 3 * blocks.num_blocks
    q, k, v, sinks = _inputs(300, sinks=True)
    ids = np.arange(280, 300)
    kw = {"scale": SCALE, "sinks": sinks, "softcap": SOFTCAP, "block_size": 8, "context_kv": (k[:280], v[:280])}
    outs = [tree_attention_torch(q[ids], k[ids], v[ids], batch, group_elements=g, **kw) for g in (256, 1 << 22)]
    grads = [torch.autograd.grad(out.square().sum(), (q, k, v, sinks)) for out in outs]
    assert_close("chunked out", outs[1].detach(), outs[0].detach())
    for name, a, b in zip("qkvs", grads[1], grads[0]):
        assert_close(f"chunked d{name}", a, b)

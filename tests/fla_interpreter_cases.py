"""Tests that run Triton kernels in Triton's CPU interpreter; ``test_ops_fla_interpreter.py`` runs
this file in a subprocess (TRITON_INTERPRET must be set before triton is imported, and the rest
of the suite must not see triton). Tiny shapes: the interpreter runs kernels in numpy.

Covered: our delta-rule state-gradient kernel; the registry choosing the fla backend; the
zero-extra-round kernels of the diagonal kinds (``diagonal.py``) and of the delta rules
(``delta.py``, on our state-gradient kernel) on fla's real chunk functions (fla's state kernels,
which the interpreter refuses, and KDA's token-parallel intra kernel, too slow there, have
PyTorch stand-ins); the tree conv on fla's
real ``causal_conv1d`` forward and backward kernels (only its dh0 kernel, which the interpreter
refuses, has a stand-in); the bench's fallback note."""

from __future__ import annotations

import os
from itertools import pairwise

os.environ["TRITON_INTERPRET"] = "1"

import fla_state_reference
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from chunk_scan_cases import assert_close
from fla.modules.causal_conv1d import ops as fla_conv_ops
from fla.ops.kda import chunk_intra as fla_kda_intra
from fla_naive_segments import naive_segments
from trees import NASTY_TREES, nasty_tree_params
from triton.runtime import autotuner, interpreter

from harts_hf.forest import RolloutForest
from harts_hf.lab.fla_report import fallback_note, sequential_calls
from harts_hf.ops import backends, tree_causal_conv1d, tree_gated_delta_rule, tree_gla, tree_kda, tree_simple_gla
from harts_hf.ops.conv import conv_halo, tree_causal_conv1d_torch
from harts_hf.ops.fla import backend, delta, diagonal
from harts_hf.ops.fla import conv as fla_conv
from harts_hf.ops.fla.delta_state_grad import delta_state_grad
from harts_hf.ops.fla.public_ops import SEGMENT_OPS
from harts_hf.ops.fla.waves import waves_of
from harts_hf.ops.gated_delta import tree_gated_delta_rule_torch
from harts_hf.ops.gla import tree_gla_torch, tree_simple_gla_torch
from harts_hf.ops.kda import tree_kda_torch
from harts_hf.ops.rounds import rounds_of
from harts_hf.ops.tree_batch import TreeBatch
from harts_hf.schedule import build_tables

# fla's kernels autotune over several configs; the interpreter cannot time them: take the first.
autotuner.Autotuner.do_bench = property(lambda self: lambda kernel_call, quantiles: [0.0, 0.0, 0.0])

# The interpreter patches triton.language anew at every call of a @triton.jit helper (fla's kernels
# call exp, sum, ... thousands of times per launch; a third of this file's time), though the
# launch patched it first and nothing restores it before the launch returns: within one launch,
# patch each language module once. Checked against triton 3.9.0 (constraints.txt).
_patch_lang, _run_grid, _patched_by_launch = interpreter._patch_lang, interpreter.GridExecutor.__call__, []


def _language_modules(fn) -> set[int]:
    return {id(m) for m in fn.__globals__.values() if m is interpreter.tl or m is interpreter.tl.core}


def _patch_lang_once(fn):
    langs = _language_modules(fn)
    if langs and _patched_by_launch and _patched_by_launch[-1] is not None and langs <= _patched_by_launch[-1]:
        return interpreter._LangPatchScope()  # already patched: nothing to restore
    scope = _patch_lang(fn)
    if _patched_by_launch:
        _patched_by_launch[-1] = (_patched_by_launch[-1] or set()) | langs
    return scope


def _run_grid_patching_once(self, *args, **kwargs):
    _patched_by_launch.append(None)  # the launch's own patch comes first
    try:
        return _run_grid(self, *args, **kwargs)
    finally:
        _patched_by_launch.pop()


interpreter._patch_lang = _patch_lang_once
interpreter.GridExecutor.__call__ = _run_grid_patching_once

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
    """HARTS_BACKEND=fla runs the fla backend on CPU under the interpreter (in the cut layout on
    naive segment kernels standing in for fla's public op, which the interpreter cannot run) and
    equals torch."""
    monkeypatch.setitem(backend.WAVES_LAYOUT, "gated_delta", "cut")
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


def interpreter_dh0(dy, y, weight, initial_state, activation, cu_seqlens, dht=None):
    """Stand-in for fla's ``compute_dh0_triton`` (its kernel's mask has a dtype the interpreter
    refuses; on a GPU fla's own kernel runs): dh0[n, :, i] = sum_{t < i} dy'[bos_n + t] * w[:, i-1-t],
    dy' = dy through the silu of the pre-activation y. Its result reaches every test below through
    the gradients of the ancestors' inputs, compared with the torch backend."""
    assert dht is None
    W = weight.shape[1]
    dy = dy[0].float()
    if activation in ("silu", "swish"):
        s = torch.sigmoid(y[0].float())
        dy = dy * s * (1 + y[0].float() * (1 - s))
    bos = cu_seqlens[:-1].long()
    lens = cu_seqlens[1:].long() - bos
    dh0 = torch.zeros_like(initial_state, dtype=torch.float32)
    for t in range(W - 1):
        rows = dy[(bos + t).clamp(max=dy.shape[0] - 1)] * (t < lens)[:, None]  # [S, D]
        for i in range(t + 1, W):
            dh0[:, :, i] += rows * weight[:, i - 1 - t].float()
    return dh0.to(initial_state.dtype)


@pytest.fixture
def conv_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """fla's conv kernel on every batch (no fragmented-batch gather), dh0 by the stand-in."""
    monkeypatch.setattr(fla_conv_ops, "compute_dh0_triton", interpreter_dh0)
    monkeypatch.setattr(fla_conv, "GATHER_BELOW_MEAN_RUN", 0.0)


def conv_inputs(n: int, seed: int, D: int = 6, W: int = 4):
    gen = torch.Generator().manual_seed(seed)
    x, weight, bias = torch.randn(n, D, generator=gen), torch.randn(D, W, generator=gen), torch.randn(D, generator=gen)
    return x.requires_grad_(), weight.requires_grad_(), bias.requires_grad_()


def conv_grads(out: torch.Tensor, cot: torch.Tensor, leaves: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return torch.autograd.grad((out * cot).sum(), leaves)


@pytest.mark.parametrize("build", nasty_tree_params())
def test_conv_matches_torch_backend(build, conv_kernel) -> None:
    """fla's kernel vs the torch backend on whole forests: outputs and the gradients of x,
    weight and bias (chain halos reach x through dh0)."""
    forest = RolloutForest.from_sequences(build(np.random.default_rng(0)))
    x, weight, bias = leaves = conv_inputs(forest.num_compact_tokens, 1)
    cot = torch.randn(x.shape, generator=torch.Generator().manual_seed(2))
    ref = tree_causal_conv1d_torch(x, weight, bias, TreeBatch.from_forest(forest), activation="silu")
    got = fla_conv.tree_causal_conv1d_fla(x, weight, bias, TreeBatch.from_forest(forest), activation="silu")
    assert_close("out", ref, got)
    for name, a, b in zip(("x", "weight", "bias"), conv_grads(ref, cot, leaves), conv_grads(got, cot, leaves)):
        assert_close(f"d{name}", a, b)


# (tree, partition): contiguous DFS thirds cut chains and hand halos over; stride 2 cuts every chain.
PIECES = [
    pytest.param("caterpillar", "thirds", id="caterpillar-thirds"),
    pytest.param("branch_at_64", "thirds", id="branch_at_64-thirds"),
    pytest.param("strict_prefix", "stride_2", id="strict_prefix-stride_2"),
]


@pytest.mark.parametrize("tree, partition", PIECES)
def test_conv_pieces_with_context(tree: str, partition: str, conv_kernel) -> None:
    """Pieces with ``context_x`` halos equal the unsplit torch backend, and the pieces' gradients
    (context rows included) sum to its gradients."""
    forest = RolloutForest.from_sequences(NASTY_TREES[tree](np.random.default_rng(0)))
    n = forest.num_compact_tokens
    x, weight, bias = leaves = conv_inputs(n, 5)
    cot = torch.randn(x.shape, generator=torch.Generator().manual_seed(6))
    ref = tree_causal_conv1d_torch(x, weight, bias, TreeBatch.from_forest(forest), activation="silu")
    pieces = np.array_split(np.arange(n), 3) if partition == "thirds" else [np.arange(r, n, 2) for r in range(2)]
    loss, halos = 0, 0
    for tokens in pieces:
        batch = TreeBatch.from_forest(forest, tokens=tokens)
        ids = batch.global_index.numpy()
        own = ids[batch.num_context :]
        halo = ids[conv_halo(batch, weight.shape[1]).numpy()] if batch.num_context else ids[:0]
        halos += halo.size
        context_x = x[halo] if halo.size else None
        out = fla_conv.tree_causal_conv1d_fla(x[own], weight, bias, batch, activation="silu", context_x=context_x)
        assert_close("piece out", ref[own].detach(), out.detach())
        loss = loss + (out * cot[own]).sum()
    assert halos >= len(pieces) - 1
    for name, a, b in zip(("x", "weight", "bias"), conv_grads(ref, cot, leaves), torch.autograd.grad(loss, leaves)):
        assert_close(f"piece d{name}", a, b)


@pytest.mark.parametrize("activation, width", [(None, 4), ("gelu", 3)], ids=["no_activation", "gelu_w3"])
def test_conv_activations_and_widths(activation: str | None, width: int, conv_kernel) -> None:
    """No activation in or after the kernel, and an activation fla lacks (applied after it)."""
    forest = RolloutForest.from_sequences(NASTY_TREES["grpo_group"](np.random.default_rng(0)))
    x, weight, _ = conv_inputs(forest.num_compact_tokens, 3, W=width)
    ref = tree_causal_conv1d_torch(x, weight, None, TreeBatch.from_forest(forest), activation=activation)
    got = fla_conv.tree_causal_conv1d_fla(x, weight, None, TreeBatch.from_forest(forest), activation=activation)
    assert_close("out", ref, got)
    for name, a, b in zip(("x", "weight"), *(torch.autograd.grad(o.square().sum(), (x, weight)) for o in (ref, got))):
        assert_close(f"d{name}", a, b)


def test_conv_registry_and_fragmented_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    """HARTS_BACKEND=fla serves conv on CPU under the interpreter; a fragmented batch takes the
    torch gather (fla's kernel would idle on 1-token chains), a GRPO group fla's kernel."""
    monkeypatch.setenv(backends.ENV, "fla")
    fragmented = TreeBatch.from_forest(
        RolloutForest.from_sequences(NASTY_TREES["one_token_nodes"](np.random.default_rng(0)))
    )
    group = TreeBatch.from_forest(RolloutForest.from_sequences(NASTY_TREES["grpo_group"](np.random.default_rng(0))))
    x, weight, bias = conv_inputs(fragmented.num_tokens, 4)
    assert backends.implementation("conv", x, weight, bias, fragmented) is fla_conv.tree_causal_conv1d_fla
    assert fla_conv.uses_gather(fragmented) and not fla_conv.uses_gather(group)
    ref = tree_causal_conv1d_torch(x, weight, bias, fragmented, activation="silu")
    assert_close("gathered", ref, tree_causal_conv1d(x, weight, bias, fragmented, activation="silu"))
    assert "torch gather" in fallback_note("conv", fragmented)
    assert fallback_note("conv", group) is None


def test_fallback_note_and_waves(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bench output: with fla serving a cut-layout kind the sequential calls are the waves (more
    than the rounds on a chain of mid-chunk branches) and a note says so; on torch, rounds, no note."""
    rng = np.random.default_rng(0)
    trunk, seqs = [], []
    for _ in range(6):  # a caterpillar of 70-token turns: a side leaf inside every other chunk
        trunk = trunk + rng.integers(0, 1 << 20, size=70).tolist()
        seqs.append(trunk + rng.integers(0, 1 << 20, size=3).tolist())
    batch = TreeBatch.from_forest(RolloutForest.from_sequences([*seqs, trunk]))
    rounds = rounds_of(batch, 64).num_rounds
    monkeypatch.setenv(backends.ENV, "fla")
    for kind in ROUNDS:  # the zero-extra-round layout: no extra waves, no note
        assert sequential_calls(kind, batch) == rounds
        assert fallback_note(kind, batch) is None
    monkeypatch.setitem(backend.WAVES_LAYOUT, "gated_delta", "cut")
    waves = sequential_calls("gated_delta", batch)
    assert waves > rounds
    assert fallback_note("gated_delta", batch) == (
        f"gated_delta: fla exact cut-path fallback (no interior-boundary state gradients), "
        f"{waves} sequential waves vs {rounds} rounds"
    )
    monkeypatch.setenv(backends.ENV, "torch")
    assert sequential_calls("gated_delta", batch) == rounds
    assert fallback_note("gated_delta", batch) is None


# Kinds in the zero-extra-round layout: (torch backend, fla backend).
ROUNDS = {
    "gla": (tree_gla_torch, backend.tree_gla_fla),
    "simple_gla": (tree_simple_gla_torch, backend.tree_simple_gla_fla),
    "gated_delta": (tree_gated_delta_rule_torch, backend.tree_gated_delta_rule_fla),
    "kda": (tree_kda_torch, backend.tree_kda_fla),
}
DELTA_RULES = ("gated_delta", "kda")


def boundary_tree(rng: np.random.Generator) -> list[list[int]]:
    """Branches reading interior chunk boundaries (C = 64) at two tree levels: a 150-token trunk,
    a leaf at 70 and at 130 (states at 64 and 128), a branch at 100 running to 160 (its path
    spans 64..160) with a grandchild at 140 (the branch path's interior boundary 128)."""
    seg = lambda n: rng.integers(0, 1 << 20, size=n).tolist()
    trunk = seg(150)
    branch = trunk[:100] + seg(60)
    return [trunk, trunk[:70] + seg(3), trunk[:130] + seg(7), branch, branch[:140] + seg(5)]


ROUNDS_TREES = {"boundaries": boundary_tree} | {
    name: NASTY_TREES[name] for name in ("caterpillar", "branch_at_63", "branch_at_64", "branch_at_65")
}


@pytest.fixture
def state_refs(monkeypatch: pytest.MonkeyPatch) -> None:
    """fla's state kernels by their PyTorch references, and KDA's token-parallel intra kernel (which
    the interpreter runs, but one program per token: minutes); every other fla function (and our
    delta-rule state-gradient kernel) runs for real."""
    monkeypatch.setitem(diagonal.STATE_KERNELS, "fwd_h", fla_state_reference.chunk_fwd_h)
    monkeypatch.setitem(diagonal.STATE_KERNELS, "bwd_dh", fla_state_reference.chunk_bwd_dh)
    monkeypatch.setitem(delta.STATE_KERNELS, "fwd_h", fla_state_reference.delta_fwd_h)
    token_parallel = fla_state_reference.kda_intra_token_parallel
    monkeypatch.setattr(fla_kda_intra, "chunk_kda_fwd_intra_token_parallel", token_parallel)


def rounds_inputs(kind: str, n: int, seed: int, key_heads: int = 1) -> dict[str, torch.Tensor]:
    """Leaves of a ``kind`` call; ``key_heads`` < H: grouped value heads (GVA). Delta-rule keys of
    norm about 1, so that I - beta k k^T stays a contraction without the l2norm."""
    gen = torch.Generator().manual_seed(seed)
    delta_rule = kind in DELTA_RULES
    x = {
        "q": torch.randn(n, key_heads, K, generator=gen),
        "k": torch.randn(n, key_heads, K, generator=gen) * (0.25 if delta_rule else 0.5),
        "v": torch.randn(n, H, V, generator=gen),
        "g": -F.softplus(torch.randn(n, H, *([K] if kind in ("gla", "kda") else []), generator=gen)) * 0.1,
    }
    if delta_rule:
        x["beta"] = torch.rand(n, H, generator=gen)
    return {name: t.requires_grad_() for name, t in x.items()}


def chunk_closing(batch: TreeBatch, chunk: int) -> torch.Tensor:
    """Combined indices of the piece tokens that close a chunk (the states a caller may ask for)."""
    nc = batch.num_context
    return torch.as_tensor(np.flatnonzero((batch.position[nc:].numpy() + 1) % chunk == 0) + nc)


def call(kind: str, backend_index: int, x, batch: TreeBatch, **kw):
    """``kind``'s torch (0) or fla (1) backend on the leaves of ``x`` (the ones a call takes)."""
    args = [x[name] for name in ("q", "k", "v", "g", "beta") if name in x]
    return ROUNDS[kind][backend_index](*args, batch, **kw)


def compare_rounds(kind: str, batch: TreeBatch, chunk: int, x, leaves, **kw) -> None:
    """o, the states after every chunk-closing token, and the gradients of ``leaves`` through both:
    the fla backend in the zero-extra-round layout vs the torch backend."""
    batch = batch.with_state_out({chunk: chunk_closing(batch, chunk)})
    ref_o, ref_s = call(kind, 0, x, batch, chunk_size=chunk, **kw)
    got_o, got_s = call(kind, 1, x, batch, chunk_size=chunk, **kw)
    assert_close("o", ref_o, got_o)
    assert_close("states", ref_s, got_s)
    gen = torch.Generator().manual_seed(9)
    wo, ws = torch.randn(ref_o.shape, generator=gen), torch.randn(ref_s.shape, generator=gen)
    loss = lambda o, s: (wo * o).sum() + (ws * s).sum()
    for name, r, g in zip(
        leaves,
        torch.autograd.grad(loss(ref_o, ref_s), list(leaves.values()), retain_graph=True),
        torch.autograd.grad(loss(got_o, got_s), list(leaves.values())),
    ):
        assert_close(f"grad {name}", r, g)


def l2_kw(kind: str, l2: bool) -> dict[str, bool]:
    return {"use_qk_l2norm": l2} if kind in DELTA_RULES else {}


CASES = (
    [pytest.param("gla", "boundaries", 64, False, id="gla-boundaries")]
    + [pytest.param("simple_gla", name, 64, False, id=f"simple_gla-{name}") for name in ROUNDS_TREES]
    + [pytest.param("simple_gla", "boundaries", 128, False, id="simple_gla-boundaries-chunk128")]
    + [
        pytest.param("gated_delta", "branch_at_63", 64, False, id="gated_delta-branch_at_63"),
        pytest.param("gated_delta", "branch_at_64", 64, True, id="gated_delta-branch_at_64-l2"),
        pytest.param("gated_delta", "branch_at_65", 64, False, id="gated_delta-branch_at_65"),
        pytest.param("gated_delta", "boundaries", 128, False, id="gated_delta-boundaries-chunk128"),
        pytest.param("kda", "branch_at_65", 64, True, id="kda-branch_at_65-l2"),
    ]
)


@pytest.mark.parametrize("kind, tree, chunk, l2", CASES)
def test_rounds_match_torch_backend(kind: str, tree: str, chunk: int, l2: bool, state_refs) -> None:
    """Whole forests: children read interior chunk-start states of their parents' calls and hand
    their gradients back (the diagonal kinds' injection, our delta-rule kernel); no extra waves.
    C = 128 takes every other of fla's 64-token chunk states."""
    forest = RolloutForest.from_sequences(ROUNDS_TREES[tree](np.random.default_rng(0)))
    batch = TreeBatch.from_forest(forest)
    assert backend.WAVES_LAYOUT[kind] == "rounds"
    assert waves_of(batch, chunk, cut=False).num_waves <= rounds_of(batch, chunk).num_rounds
    x = rounds_inputs(kind, forest.num_compact_tokens, 1)
    compare_rounds(kind, batch, chunk, x, x, **l2_kw(kind, l2))


@pytest.mark.parametrize("kind", list(ROUNDS))
def test_rounds_piece_matches_torch_backend(kind: str, state_refs) -> None:
    """A piece below the first chunk boundary: context replay, external initial states (a leaf:
    their gradient is compared too) and state outputs at interior boundaries, children at both
    tree levels of the boundary tree (the delta rules' only C = 64 case on it); the delta rules
    with as many key heads as value heads and the l2norm."""
    forest = RolloutForest.from_sequences(boundary_tree(np.random.default_rng(0)))
    piece = TreeBatch.from_forest(forest, tokens=np.flatnonzero(forest.position >= 66))
    rounds = rounds_of(piece, 64)
    assert rounds.context_replay.numel() and rounds.external_tokens.numel()
    x = rounds_inputs(kind, forest.num_compact_tokens, 2, key_heads=H if kind in DELTA_RULES else 1)
    ids, nc = piece.global_index, piece.num_context
    own = {name: t[ids[nc:]] for name, t in x.items()}
    context = {name: t[ids[rounds.context_replay]] for name, t in x.items() if name != "q"}
    gen = torch.Generator().manual_seed(3)
    states = torch.randn(rounds.external_tokens.numel(), H, K, V, generator=gen).requires_grad_()
    leaves = {**x, "initial_states": states}
    compare_rounds(kind, piece, 64, own, leaves, context=context, initial_states=states, **l2_kw(kind, True))


@pytest.mark.parametrize("kind", ["simple_gla", "gated_delta"])
def test_rounds_states_only_gradients(kind: str, state_refs) -> None:
    """A loss on the state outputs alone (no gradient reaches o: fla's kernels get a zero do)."""
    forest = RolloutForest.from_sequences(boundary_tree(np.random.default_rng(0)))
    batch = TreeBatch.from_forest(forest)
    batch = batch.with_state_out({64: chunk_closing(batch, 64)})
    x = rounds_inputs(kind, forest.num_compact_tokens, 4)
    names = [name for name in x if name != "q"]
    leaves = [x[name] for name in names]
    ref, got = (call(kind, i, x, batch)[1] for i in (0, 1))
    for name, r, g in zip(
        names, torch.autograd.grad(ref.square().sum(), leaves), torch.autograd.grad(got.square().sum(), leaves)
    ):
        assert_close(f"grad {name}", r, g)


def test_every_fla_name_the_backend_reads_resolves() -> None:
    """The door's names all import from the checked fla release (a name fla moves fails here)."""
    from harts_hf.ops.fla import _compat

    assert _compat.fla_checked()
    missing = []
    for key, name in _compat.NAMES.items():
        try:
            name.get()
        except (ImportError, AttributeError) as err:
            missing.append(f"{key}: {name.module}.{name.attr} ({err})")
    assert not missing, missing
    assert callable(_compat.chunk_fwd_o.get()) and _compat.RCP_LN2.get() > 1.0


PUBLIC = {"gated_delta": tree_gated_delta_rule, "kda": tree_kda, "gla": tree_gla, "simple_gla": tree_simple_gla}


@pytest.mark.parametrize("kind", list(PUBLIC))
def test_fla_linear_backends_read_the_tables_they_declare(kind: str, state_refs, monkeypatch) -> None:
    """``backends.tables_of`` the fla backend's call: built ahead (the batch sealed), the call reads
    nothing else, and on a fresh batch it builds exactly those (``model_tables`` relies on it)."""
    monkeypatch.setenv(backends.ENV, "fla")
    forest = RolloutForest.from_sequences(ROUNDS_TREES["branch_at_65"](np.random.default_rng(0)))
    x = rounds_inputs(kind, forest.num_compact_tokens, 1)
    args = [x[name].detach() for name in ("q", "k", "v", "g", "beta") if name in x]
    fresh = TreeBatch.from_forest(forest)
    call = backends.call_of(kind, *args, fresh, chunk_size=64)
    assert backends.choose(call).fn.__name__.endswith("_fla")
    ahead = build_tables(TreeBatch.from_forest(forest), frozenset(backends.tables_of(call)), "cpu")
    with torch.no_grad():
        PUBLIC[kind](*args, ahead, chunk_size=64)
        PUBLIC[kind](*args, fresh, chunk_size=64)
    assert fresh.tables == ahead.tables


@pytest.mark.parametrize("tree", ["one_token_nodes", "grpo_group"])
def test_fla_conv_reads_the_tables_it_declares(tree: str, monkeypatch) -> None:
    """The fla conv's tables, on a fragmented batch (the torch gather, built with its runs table) and
    on long runs (fla's kernel)."""
    monkeypatch.setenv(backends.ENV, "fla")
    forest = RolloutForest.from_sequences(NASTY_TREES[tree](np.random.default_rng(0)))
    x, weight, bias = (t.detach() for t in conv_inputs(forest.num_compact_tokens, 4))
    fresh = TreeBatch.from_forest(forest)
    tables = frozenset(backends.tables_of(backends.call_of("conv", x, weight, bias, fresh)))
    ahead = build_tables(TreeBatch.from_forest(forest), tables, "cpu")
    with torch.no_grad():
        tree_causal_conv1d(x, weight, bias, ahead, activation="silu")
        tree_causal_conv1d(x, weight, bias, fresh, activation="silu")
    assert fresh.tables == ahead.tables
    assert (fla_conv.runs_of(fresh, 4) is None) == (tree == "one_token_nodes")

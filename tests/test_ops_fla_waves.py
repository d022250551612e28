"""The fla backend's glue (waves in both layouts, varlen packing, state bank, bounded replay,
pieces) on CPU for every kind, delta rules included (their l2norm and grouped value heads too):
fla's kernels swapped for fla's naive references (``fla_naive_segments.py``,
``fla_naive_chunks.py``), compared with the torch backend on the nasty trees, forward and every
gradient, fp32; and the diagonal kinds' state-gradient injection against autograd. fla's real
kernels run in ``fla_interpreter_cases.py`` (Triton's interpreter) and ``scripts/gpu_check.py``."""

from __future__ import annotations

from itertools import pairwise

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from chunk_scan_cases import assert_close, check_piece
from fla_naive_chunks import naive_chunk_states
from fla_naive_segments import naive_segments
from trees import NASTY_TREES, nasty_tree_params

from harts_hf.forest import RolloutForest
from harts_hf.lab.fla_report import fallback_note, sequential_calls
from harts_hf.ops import backends
from harts_hf.ops.backends import Call
from harts_hf.ops.fla import backend
from harts_hf.ops.fla.diagonal import inject_state_grads
from harts_hf.ops.fla.public_ops import SEGMENT_OPS
from harts_hf.ops.fla.waves import ChunkSteps, waves_of
from harts_hf.ops.gated_delta import tree_gated_delta_rule_torch
from harts_hf.ops.gla import tree_gla_torch, tree_simple_gla_torch
from harts_hf.ops.kda import tree_kda_torch
from harts_hf.ops.rounds import rounds_of
from harts_hf.ops.tree_batch import TreeBatch

HK, H, K, V = 1, 2, 8, 4  # HK < H: grouped value heads (GVA)
CHUNK = 16
KINDS = {
    "gated_delta": (tree_gated_delta_rule_torch, backend.tree_gated_delta_rule_fla),
    "kda": (tree_kda_torch, backend.tree_kda_fla),
    "gla": (tree_gla_torch, backend.tree_gla_fla),
    "simple_gla": (tree_simple_gla_torch, backend.tree_simple_gla_fla),
}


# The real kernels and layouts (the fixtures below swap them).
DEFAULT_LAYOUT, DEFAULT_ROUNDS_OPS = dict(backend.WAVES_LAYOUT), dict(backend.ROUNDS_OPS)


@pytest.fixture(autouse=True)
def naive_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    for kind in SEGMENT_OPS:
        monkeypatch.setitem(SEGMENT_OPS, kind, naive_segments(kind))
        monkeypatch.setitem(backend.ROUNDS_OPS, kind, naive_chunk_states(kind, CHUNK))


@pytest.fixture(params=["cut", "rounds"])
def layout(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every kind in the exact cut layout, then in the zero-extra-round layout."""
    for kind in SEGMENT_OPS:
        monkeypatch.setitem(backend.WAVES_LAYOUT, kind, request.param)
    return request.param


def inputs(kind: str, n: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    per_channel = kind in ("kda", "gla")
    x = {
        "q": torch.randn(n, HK, K, generator=gen),
        "k": torch.randn(n, HK, K, generator=gen) * 0.5,
        "v": torch.randn(n, H, V, generator=gen),
        "g": -F.softplus(torch.randn(n, H, *([K] if per_channel else []), generator=gen)) * 0.05,
    }
    if kind in ("gated_delta", "kda"):
        x["beta"] = torch.rand(n, H, generator=gen)
    return {name: t.requires_grad_() for name, t in x.items()}


def call(fn, x: dict[str, torch.Tensor], batch: TreeBatch, chunk: int, **kw):
    args = [x[n] for n in ("q", "k", "v", "g", "beta") if n in x]
    return fn(*args, batch, chunk_size=chunk, **kw)


@pytest.mark.parametrize("build", nasty_tree_params())
@pytest.mark.parametrize("kind", list(KINDS))
def test_tree_matches_torch_backend(build, kind: str, layout: str) -> None:
    chunk = CHUNK
    forest = RolloutForest.from_sequences(build(np.random.default_rng(0)))
    batch = TreeBatch.from_forest(forest)
    x = inputs(kind, forest.num_compact_tokens, 1)
    torch_fn, fla_fn = KINDS[kind]
    ref = call(torch_fn, x, TreeBatch.from_forest(forest), chunk)[0]
    got = call(fla_fn, x, batch, chunk)[0]
    assert_close("o", ref, got)
    weight = torch.randn(ref.shape, generator=torch.Generator().manual_seed(2))
    leaves = list(x.values())
    for name, r, g in zip(
        x, torch.autograd.grad((weight * ref).sum(), leaves), torch.autograd.grad((weight * got).sum(), leaves)
    ):
        assert_close(f"grad {name}", r, g)
    # Children at a parent's start boundary share its wave, so waves never exceed rounds uncut.
    uncut = waves_of(batch, chunk, cut=False).num_waves
    assert uncut <= rounds_of(batch, chunk).num_rounds
    assert waves_of(batch, chunk, cut=True).num_waves >= uncut


@pytest.mark.parametrize("kind", list(KINDS))
def test_piece_with_context_and_states(kind: str, layout: str) -> None:
    """A piece cut below a branch: context replay, external initial states and state outputs,
    gradients through the handed-over states."""
    chunk = CHUNK
    forest = RolloutForest.from_sequences(NASTY_TREES["caterpillar"](np.random.default_rng(0)))
    x = inputs(kind, forest.num_compact_tokens, 3)
    fla_fn = KINDS[kind][1]

    def run(batch, own_rows, ctx_rows, states):
        own = {n: t[own_rows] for n, t in x.items()}
        context = None if ctx_rows is None else {n: t[ctx_rows] for n, t in x.items() if n != "q"}
        return call(fla_fn, own, batch, chunk, context=context, initial_states=states)

    depth = 3 * chunk + 5
    check_piece(forest, np.flatnonzero(forest.position >= depth), chunk, x, run)


@pytest.mark.parametrize("tree", ["caterpillar", "deep_chain"])
@pytest.mark.parametrize("kind", ["gated_delta", "kda"])
def test_delta_rules_with_l2norm(kind: str, tree: str, layout: str) -> None:
    """The delta rules' in-kernel q/k l2norm reaches the segment kernels of both layouts; o and
    every gradient equal the torch backend's."""
    forest = RolloutForest.from_sequences(NASTY_TREES[tree](np.random.default_rng(0)))
    x = inputs(kind, forest.num_compact_tokens, 6)
    torch_fn, fla_fn = KINDS[kind]
    ref = call(torch_fn, x, TreeBatch.from_forest(forest), CHUNK, use_qk_l2norm=True)[0]
    got = call(fla_fn, x, TreeBatch.from_forest(forest), CHUNK, use_qk_l2norm=True)[0]
    assert_close("o", ref, got)
    leaves = list(x.values())
    for name, r, g in zip(x, torch.autograd.grad(ref.sum(), leaves), torch.autograd.grad(got.sum(), leaves)):
        assert_close(f"grad {name}", r, g)


def test_every_kind_defaults_to_the_zero_extra_round_layout() -> None:
    """Each kind runs the rounds layout by default, on a kernel that returns per-chunk states."""
    assert set(DEFAULT_LAYOUT.values()) == {"rounds"}
    assert set(DEFAULT_ROUNDS_OPS) == set(DEFAULT_LAYOUT) == set(KINDS)


def test_state_outputs_match_torch_backend(layout: str) -> None:
    """States after chunk-closing tokens equal the torch backend's (cut layout cuts there too)."""
    chunk = CHUNK
    forest = RolloutForest.from_sequences(NASTY_TREES["deep_chain"](np.random.default_rng(0)))
    x = inputs("gated_delta", forest.num_compact_tokens, 4)
    out = {chunk: np.flatnonzero((forest.position + 1) % chunk == 0)}
    ref = call(tree_gated_delta_rule_torch, x, TreeBatch.from_forest(forest).with_state_out(out), chunk)[1]
    got = call(backend.tree_gated_delta_rule_fla, x, TreeBatch.from_forest(forest).with_state_out(out), chunk)[1]
    assert_close("states", ref, got)
    assert_close("grad v", *(torch.autograd.grad(s.square().sum(), x["v"])[0] for s in (ref, got)))


@pytest.mark.parametrize("kind", list(KINDS))
def test_bench_sees_rounds_when_fla_does_not_serve(kind: str) -> None:
    """Without fla serving the call (no triton here), bench output keeps the torch rounds and no note."""
    batch = TreeBatch.from_forest(RolloutForest.from_sequences(NASTY_TREES["deep_chain"](np.random.default_rng(0))))
    assert not backend.fla_available()
    assert sequential_calls(kind, batch) == rounds_of(batch, 64).num_rounds
    assert fallback_note(kind, batch) is None


@pytest.mark.parametrize("per_channel", [False, True], ids=["per_head", "per_channel"])
def test_inject_state_grads_matches_autograd(per_channel: bool) -> None:
    """The diagonal kinds' injection (``diagonal.inject_state_grads``) turns the state gradients
    of a chunk recurrence without interior gradients into those with them, as autograd does
    through h_{c+1} = 2^{G_c} * h_c + u_c (G_c: chunk c's total log2 gate) with <ext_c, h_c>
    added to the loss."""
    gen = torch.Generator().manual_seed(0)
    cu = [0, 40, 56, 57, 89, 153]  # 3, 1, 1, 2 and 4 chunks of 16: a 1-token sequence, odd tails
    nt, S = 11, len(cu) - 1
    gc = -torch.rand(cu[-1], H, *([K] if per_channel else []), generator=gen)  # per-token log2 gates
    chunks = [slice(s, min(s + CHUNK, hi)) for lo, hi in pairwise(cu) for s in range(lo, hi, CHUNK)]
    for sl in chunks:
        gc[sl] = gc[sl].cumsum(0)  # chunk-local, as fla's kernels take them
    u, ext, w = (torch.randn(nt, H, K, V, generator=gen) for _ in range(3))  # w: loss weights on end states
    dht = torch.randn(S, H, K, V, generator=gen)

    def grads(with_ext: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Autograd gradients of every chunk's end state and of every initial state."""
        h0 = torch.randn(S, H, K, V, generator=torch.Generator().manual_seed(1), requires_grad=True)
        ends, loss, row = [], 0.0, 0
        for n, (lo, hi) in enumerate(pairwise(cu)):
            h = h0[n]
            for _ in range(-(-(hi - lo) // CHUNK)):
                loss = loss + (ext[row] * h).sum() * with_ext
                decay = gc[chunks[row]][-1].exp2().reshape(H, -1, 1)
                h = decay * h + u[row]
                h.retain_grad()
                ends.append(h)
                loss = loss + (w[row] * h).sum()
                row += 1
            loss = loss + (dht[n] * h).sum()
        loss.backward()
        return torch.stack([e.grad for e in ends]), h0.grad

    dh, dh0 = grads(with_ext=False)
    inject_state_grads(dh, dh0, ext, gc, ChunkSteps.of(np.asarray(cu), CHUNK, torch.device("cpu")))
    ref_dh, ref_dh0 = grads(with_ext=True)
    assert not torch.allclose(dh0, grads(with_ext=False)[1])
    assert_close("dh", ref_dh, dh)
    assert_close("dh0", ref_dh0, dh0)


def test_fla_refuses_gpu_head_dims_below_its_tiles() -> None:
    """On a GPU the fla backend takes only head dims its tl.dot tiles fit (>= 16); a Mamba v1 layer
    (GLA with V = 1) goes to the torch backend instead of failing to compile."""
    gpu = lambda k, v, chunk: Call("gla", torch.device("cuda"), chunk, key_dim=k, value_dim=v)
    assert backend._accepts(gpu(64, 64, 64))
    assert not backend._accepts(gpu(16, 1, 64))
    assert not backend._accepts(gpu(64, 64, 32))


def test_gated_kinds_leave_fla_where_it_refuses_their_backward(monkeypatch: pytest.MonkeyPatch) -> None:
    """On Hopper with Triton 3.4 - 3.7.0 fla refuses gated chunk backward (fla #640): GDN and simple
    GLA go to the torch backend instead of failing mid-backward; KDA and GLA keep fla's kernels."""
    gpu = lambda kind: Call(kind, torch.device("cuda"), 64, key_dim=64, value_dim=64)
    accepts = lambda kind: backends._REGISTRY[kind]["fla"].accepts(gpu(kind))
    monkeypatch.setattr(backend, "fla_refuses_gated_backward", lambda: False)
    assert all(accepts(kind) for kind in KINDS)
    monkeypatch.setattr(backend, "fla_refuses_gated_backward", lambda: True)
    assert [kind for kind in KINDS if accepts(kind)] == ["kda", "gla"]

"""The fla backend's glue (waves, varlen packing, state bank, bounded replay, pieces) on CPU:
fla's kernels swapped for fla's naive references (``fla_naive_segments.py``), compared with the
torch backend on the nasty trees, forward and every gradient, fp32. The real kernels are compared
in ``scripts/gpu_check.py`` on a GPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from chunk_scan_cases import assert_close, check_piece
from fla_naive_segments import naive_segments
from trees import NASTY_TREES, nasty_tree_params

from harts_hf.forest import RolloutForest
from harts_hf.ops.fla import backend, fallback_note, sequential_calls
from harts_hf.ops.fla.public_ops import SEGMENT_OPS
from harts_hf.ops.fla.waves import waves_of
from harts_hf.ops.gated_delta import tree_gated_delta_rule_torch
from harts_hf.ops.gla import tree_gla_torch, tree_simple_gla_torch
from harts_hf.ops.kda import tree_kda_torch
from harts_hf.ops.rounds import rounds_of
from harts_hf.ops.tree_batch import TreeBatch

HK, H, K, V = 1, 2, 8, 4
KINDS = {
    "gated_delta": (tree_gated_delta_rule_torch, backend.tree_gated_delta_rule_fla),
    "kda": (tree_kda_torch, backend.tree_kda_fla),
    "gla": (tree_gla_torch, backend.tree_gla_fla),
    "simple_gla": (tree_simple_gla_torch, backend.tree_simple_gla_fla),
}


@pytest.fixture(autouse=True)
def naive_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    for kind in SEGMENT_OPS:
        monkeypatch.setitem(SEGMENT_OPS, kind, naive_segments(kind))


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
def test_tree_matches_torch_backend(build, kind: str) -> None:
    chunk = 16
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
def test_piece_with_context_and_states(kind: str) -> None:
    """A piece cut below a branch: context replay, external initial states and state outputs,
    gradients through the handed-over states."""
    chunk = 16
    forest = RolloutForest.from_sequences(NASTY_TREES["caterpillar"](np.random.default_rng(0)))
    x = inputs(kind, forest.num_compact_tokens, 3)
    fla_fn = KINDS[kind][1]

    def run(batch, own_rows, ctx_rows, states, out_tokens):
        own = {n: t[own_rows] for n, t in x.items()}
        context = None if ctx_rows is None else {n: t[ctx_rows] for n, t in x.items() if n != "q"}
        return call(fla_fn, own, batch, chunk, context=context, initial_states=states, state_out_tokens=out_tokens)

    depth = 3 * chunk + 5
    check_piece(forest, np.flatnonzero(forest.position >= depth), chunk, x, run)


def test_state_outputs_match_torch_backend() -> None:
    """States after chunk-closing tokens equal the torch backend's (cut layout cuts there too)."""
    chunk = 16
    forest = RolloutForest.from_sequences(NASTY_TREES["deep_chain"](np.random.default_rng(0)))
    batch = TreeBatch.from_forest(forest)
    x = inputs("gated_delta", forest.num_compact_tokens, 4)
    out = torch.as_tensor(np.flatnonzero((forest.position + 1) % chunk == 0))
    ref = call(tree_gated_delta_rule_torch, x, TreeBatch.from_forest(forest), chunk, state_out_tokens=out)[1]
    got = call(backend.tree_gated_delta_rule_fla, x, batch, chunk, state_out_tokens=out)[1]
    assert_close("states", ref, got)
    assert_close("grad v", *(torch.autograd.grad(s.square().sum(), x["v"])[0] for s in (ref, got)))


@pytest.mark.parametrize("kind", list(KINDS))
def test_bench_sees_rounds_when_fla_does_not_serve(kind: str) -> None:
    """Without fla serving the call (no triton here), bench output keeps the torch rounds and no note."""
    batch = TreeBatch.from_forest(RolloutForest.from_sequences(NASTY_TREES["deep_chain"](np.random.default_rng(0))))
    assert not backend.fla_available()
    assert sequential_calls(kind, batch) == rounds_of(batch, 64).num_rounds
    assert fallback_note(kind, batch) is None

"""Shared checks for linear-attention tree ops: kernels on step-major packed paths, tree ops on whole
forests and on pieces, each against an oracle nobody here wrote.

A kernel gets P paths of different lengths packed the way the tree driver packs a round (chunk 0 of
every path, then chunk 1 of the paths that have one, ...; tails right-padded with zeros, the neutral
token). The oracle runs each path alone from the same initial state; chunk-start states come from
the oracle run on the path's chunk-aligned prefixes. Outputs, chunk-start states, final states and
the gradients of a random linear functional of all three w.r.t. every input and h0 must agree.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import numpy as np
import torch
import torch.nn.functional as F

from harts_hf.forest import RolloutForest
from harts_hf.ops.rounds import rounds_of
from harts_hf.ops.tree_batch import TreeBatch

Oracle = Callable[[dict[str, torch.Tensor], torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def fla_naive(kind: str) -> ModuleType:
    """fla's pure-torch reference ``fla/ops/<kind>/naive.py``, loaded alone (fla's ops package needs triton)."""
    root = importlib.util.find_spec("fla").submodule_search_locations[0]
    spec = importlib.util.spec_from_file_location(f"fla_naive_{kind}", Path(root) / "ops" / kind / "naive.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def assert_close(name: str, ref: torch.Tensor, got: torch.Tensor, ratio: float = 1e-5) -> None:
    """max |ref - got| <= ratio * max |ref| (the scale of the reference)."""
    assert ref.shape == got.shape, f"{name}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    err = (ref - got).abs().max().item()
    scale = max(ref.abs().max().item(), 1e-12)
    assert err <= ratio * scale, f"{name}: max abs diff {err:.3e} > {ratio:.0e} * {scale:.3e}"


def chunk_counts(lengths: list[int], chunk: int) -> list[int]:
    return [-(-t // chunk) for t in lengths]


def step_counts(lengths: list[int], chunk: int) -> list[int]:
    """Active paths per chunk step; paths must be sorted by chunk count, descending."""
    counts = chunk_counts(lengths, chunk)
    assert counts == sorted(counts, reverse=True), "paths must be sorted by chunk count"
    return [sum(c > m for c in counts) for m in range(counts[0])]


def pack(paths: list[torch.Tensor], chunk: int) -> torch.Tensor:
    """[T_p, ...] per path -> [Tc, C, ...] step-major, tails zero-padded."""
    counts = chunk_counts([p.shape[0] for p in paths], chunk)
    chunks = [
        F.pad(p, (0, 0) * (p.dim() - 1) + (0, n * chunk - p.shape[0])).reshape(n, chunk, *p.shape[1:])
        for p, n in zip(paths, counts)
    ]
    return torch.cat([torch.stack([c[m] for c in chunks if c.shape[0] > m]) for m in range(counts[0])])


def unpack(packed: torch.Tensor, lengths: list[int], chunk: int) -> list[torch.Tensor]:
    """Inverse of :func:`pack`: path p's rows [n_p, ...] of a per-chunk tensor (outputs, chunk-start states)."""
    steps = step_counts(lengths, chunk)
    offsets = [sum(steps[:m]) for m in range(len(steps))]
    return [packed[[offsets[m] + p for m in range(n)]] for p, n in enumerate(chunk_counts(lengths, chunk))]


def check_kernel(
    kernel: Callable,
    oracle: Oracle,
    inputs: list[dict[str, torch.Tensor]],
    h0: torch.Tensor,
    chunk: int,
    scale: float,
    ratio: float = 1e-5,
) -> None:
    """Kernel on all paths packed vs ``oracle`` per path: forward values and every gradient."""
    lengths = [d["q"].shape[0] for d in inputs]
    leaves = [{n: x.clone().requires_grad_() for n, x in d.items()} for d in inputs]
    h0_leaf = h0.clone().requires_grad_()
    gen = torch.Generator().manual_seed(7)

    names = ["q", "k", "v", "g", "beta"]
    packed = {n: pack([d[n] for d in leaves], chunk) if n in leaves[0] else None for n in names}
    o, h_start, h_final = kernel(**packed, h0=h0_leaf, step_counts=step_counts(lengths, chunk), scale=scale)
    got_o = [x.flatten(0, 1)[:t] for x, t in zip(unpack(o, lengths, chunk), lengths)]
    got_start = unpack(h_start, lengths, chunk)

    ref_o, ref_start, ref_final = [], [], []
    for p, (d, t) in enumerate(zip(leaves, lengths)):
        out, final = oracle(d, h0_leaf[p])
        ref_o.append(out)
        ref_final.append(final)
        # State at the start of chunk m = the oracle's final state on the first m chunks.
        prefix = [oracle({n: x[: m * chunk] for n, x in d.items()}, h0_leaf[p])[1] for m in range(1, -(-t // chunk))]
        ref_start.append(torch.stack([h0_leaf[p], *prefix]))

    for p in range(len(inputs)):
        assert_close(f"o[path {p}]", ref_o[p], got_o[p], ratio)
        assert_close(f"h_start[path {p}]", ref_start[p], got_start[p], ratio)
    assert_close("h_final", torch.stack(ref_final), h_final, ratio)

    weights = [torch.randn(x.shape, generator=gen) for x in ref_o + ref_start + [torch.stack(ref_final)]]

    def grads(values: list[torch.Tensor]) -> list[torch.Tensor]:
        loss = sum((w * x).sum() for w, x in zip(weights, values))
        flat = [h0_leaf] + [x for d in leaves for x in d.values()]
        return torch.autograd.grad(loss, flat)

    ref_grads = grads(ref_o + ref_start + [torch.stack(ref_final)])
    got_grads = grads(got_o + got_start + [h_final])
    labels = ["h0"] + [f"{n}[path {p}]" for p, d in enumerate(leaves) for n in d]
    for label, ref, got in zip(labels, ref_grads, got_grads):
        assert_close(f"grad {label}", ref, got, ratio)


def padded_index(forest: RolloutForest) -> tuple[torch.Tensor, torch.Tensor]:
    """([B, T] compact index of each trajectory token, N past the end; [B, T] valid mask)."""
    idx = forest.padded(forest.restore, fill=forest.num_compact_tokens)
    valid = forest.padded(np.ones(forest.num_trajectory_tokens, dtype=bool), fill=False)
    return torch.as_tensor(idx), torch.as_tensor(valid)


def check_tree(
    forest: RolloutForest,
    leaves: dict[str, torch.Tensor],
    tree_fn: Callable[[TreeBatch], torch.Tensor],
    oracle: Callable[[Callable[[torch.Tensor], torch.Tensor]], torch.Tensor],
    ratio: float = 1e-5,
) -> None:
    """Tree op on the whole forest vs ``oracle`` on every trajectory (a right-padded batch of them).

    ``tree_fn(batch)`` returns o [N, ...] for the compact tokens; ``oracle(per_traj)`` returns
    o [B, T, ...], where ``per_traj(x)`` turns a compact-token tensor [N, ...] into the trajectories'
    right-padded [B, T, ...] (zeros past the end; padded outputs are never compared). Forward outputs
    and the gradients of a random functional of the valid outputs w.r.t. every leaf must agree.
    """
    idx, valid = padded_index(forest)

    def per_traj(x: torch.Tensor) -> torch.Tensor:
        return torch.cat((x, x.new_zeros(1, *x.shape[1:])))[idx]

    got = per_traj(tree_fn(TreeBatch.from_forest(forest)))
    ref = oracle(per_traj)
    assert_close("o", ref[valid], got[valid], ratio)
    weight = torch.randn(ref.shape, generator=torch.Generator().manual_seed(3))
    weight = weight * valid.reshape(*valid.shape, *[1] * (ref.dim() - 2))
    names = list(leaves)
    ref_grads = torch.autograd.grad((weight * ref).sum(), [leaves[n] for n in names])
    got_grads = torch.autograd.grad((weight * got).sum(), [leaves[n] for n in names])
    for name, r, g in zip(names, ref_grads, got_grads):
        assert_close(f"grad {name}", r, g, ratio)


Run = Callable[[TreeBatch, torch.Tensor, torch.Tensor | None, torch.Tensor | None], tuple]


def check_piece(
    forest: RolloutForest, piece_tokens: np.ndarray, chunk: int, leaves: dict[str, torch.Tensor], run: Run
) -> None:
    """A piece run after the whole forest handed it its boundary states == the whole-forest run.

    ``run(batch, own_rows, context_rows, initial_states)`` calls the tree op with the leaves' rows
    ``own_rows`` as inputs and ``context_rows`` (the replayed context tokens) as context (None: no
    context) and returns (o, the
    states after ``batch.state_out``). The piece's gradients flow back through the handed-over states, so the
    piece-plus-rest loss must give the whole-forest gradients.
    """
    whole = TreeBatch.from_forest(forest)
    piece = TreeBatch.from_forest(forest, tokens=piece_tokens)
    nc = piece.num_context
    rounds = rounds_of(piece, chunk)
    external = piece.global_index[rounds.external_tokens]
    assert rounds.context_replay.numel() and external.numel(), "the piece must need context replay and boundary states"
    o_whole, states = run(whole.with_state_out({chunk: external.numpy()}), whole.global_index, None, None)
    own = piece.global_index[nc:]
    o_piece, _ = run(piece, own, piece.global_index[rounds.context_replay], states)
    assert_close("piece o", o_whole[own], o_piece)

    weight = torch.randn(o_whole.shape, generator=torch.Generator().manual_seed(5))
    rest = torch.ones(o_whole.shape[0], dtype=torch.bool)
    rest[own] = False
    names = list(leaves)
    ref_grads = torch.autograd.grad((weight * o_whole).sum(), [leaves[n] for n in names], retain_graph=True)
    piece_loss = (weight[rest] * o_whole[rest]).sum() + (weight[own] * o_piece).sum()
    got_grads = torch.autograd.grad(piece_loss, [leaves[n] for n in names])
    for name, r, g in zip(names, ref_grads, got_grads):
        assert_close(f"piece grad {name}", r, g)

"""Short causal depthwise convolution on a tree batch (the conv in front of GDN / KDA / Mamba2 /
LFM2 mixers).

On a trajectory ``out[t] = act(bias + sum_j weight[:, W-1-j] * x[t-j])``; on a tree ``t - j``
becomes ``prev^j(t)``, the j-th ancestor, and the input is zero past a root, exactly as the
zero padding of every trajectory's conv. A per-batch gather table [N, W] of ancestor indices
turns it into W gathers; context tokens (ancestors from an earlier microbatch) provide the halo:
only the context tokens some piece token reaches within W - 1 steps (:func:`conv_halo`), which is
all a piece holds of its context for a conv layer, and the table indexes the *local* rows
``[halo, piece tokens, zero row]``.

Legend: N piece tokens, Nc context tokens, Nk = Nc + N (combined space), H halo tokens (<= Nc),
D channels, W width.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.autograd.function import once_differentiable
from transformers.activations import ACT2FN

from .backends import Call, dispatch, register
from .precision import without_autocast
from .tree_batch import Table, TreeBatch

__all__ = [
    "ConvGatherTable",
    "ConvHaloTable",
    "conv_halo",
    "local_rows",
    "tree_causal_conv1d",
    "tree_causal_conv1d_torch",
]


def _combined_table(batch: TreeBatch, width: int) -> torch.Tensor:
    """[N, W] combined index of ``prev^(W-1-c)(t)`` in column c; Nk (a zero row) past a root."""
    nk = batch.prev.numel()
    up = torch.where(batch.prev >= 0, batch.prev, nk)
    up = torch.cat((up, up.new_tensor([nk])))  # the zero row is its own parent
    table = torch.empty(batch.num_tokens, width, dtype=torch.long, device=batch.device)
    cur = torch.arange(batch.num_context, nk, device=batch.device)
    table[:, -1] = cur
    for c in range(width - 2, -1, -1):  # one vectorised pointer jump per tap
        cur = up[cur]
        table[:, c] = cur
    return table


@dataclass(frozen=True)
class ConvHaloTable(Table):
    """The halo of a width-``width`` conv (:func:`conv_halo`): what a unit's handoff gives its conv layers."""

    width: int
    context_subset = True

    def build(self, batch: TreeBatch) -> torch.Tensor:
        table = _combined_table(batch, self.width)
        return torch.unique(table[table < batch.num_context])

    @property
    def reach(self) -> int:
        return self.width - 1  # the tokens before a path's first own one


@dataclass(frozen=True)
class ConvGatherTable(Table):
    """The torch backend's gather table of a width-``width`` conv (``_gather_table``)."""

    width: int

    def build(self, batch: TreeBatch) -> torch.Tensor:
        return _gather_table(batch, self.width)


def conv_halo(batch: TreeBatch, width: int) -> torch.Tensor:
    """[H] combined indices (ascending) of the context tokens a width-``width`` conv reads: the
    ancestors within ``width - 1`` steps of a piece token that lie in the context."""
    return batch.cached(ConvHaloTable(width))


def local_rows(batch: TreeBatch, width: int, combined: torch.Tensor) -> torch.Tensor:
    """``combined`` indices (context, piece or Nk) as rows of ``[halo, piece tokens, zero row]``."""
    halo, nc = conv_halo(batch, width), batch.num_context
    return torch.where(combined < nc, torch.searchsorted(halo, combined), combined - nc + halo.numel())


def _gather_table(batch: TreeBatch, width: int) -> torch.Tensor:
    """[N, W] local row (``local_rows``) of ``prev^(W-1-c)(t)`` in column c."""
    return local_rows(batch, width, _combined_table(batch, width))


def _acc(x: torch.Tensor) -> torch.dtype:
    """Accumulation dtype: fp32 for half precision, else the input's."""
    return torch.promote_types(x.dtype, torch.float32)


class _Conv(torch.autograd.Function):
    """``out[t] = sum_c weight[:, c] * xa[table[t, c]]``, one [N, D] gather live at a time."""

    @staticmethod
    def forward(ctx, xa: torch.Tensor, weight: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        acc = _acc(xa)
        out = xa.new_zeros(table.shape[0], xa.shape[1], dtype=acc)  # [N, D]
        for c in range(table.shape[1]):
            out.addcmul_(xa.index_select(0, table[:, c]).to(acc), weight[:, c].to(acc))
        ctx.save_for_backward(xa, weight, table)
        return out.to(xa.dtype)

    @staticmethod
    @once_differentiable
    @without_autocast
    def backward(ctx, grad: torch.Tensor):
        xa, weight, table = ctx.saved_tensors
        acc = _acc(xa)
        grad = grad.to(acc)
        dxa = torch.zeros_like(xa, dtype=acc)  # [H + N + 1, D]
        dweight = torch.empty_like(weight, dtype=acc)  # [D, W]
        for c in range(table.shape[1]):
            dxa.index_add_(0, table[:, c], grad * weight[:, c].to(acc))
            dweight[:, c] = (grad * xa.index_select(0, table[:, c]).to(acc)).sum(0)
        return dxa.to(xa.dtype), dweight.to(weight.dtype), None


def check_conv_args(x, weight, bias, batch, context_x, activation=None) -> None:
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[0] != x.shape[1] or weight.shape[1] < 1:
        raise ValueError(f"x {tuple(x.shape)}, weight {tuple(weight.shape)}: need x [N, D] and weight [D, W], W >= 1")
    if activation is not None and activation not in ACT2FN:
        raise ValueError(f"unknown activation {activation!r}: use an ACT2FN name (e.g. 'silu') or None")
    if bias is not None and bias.shape != (x.shape[1],):
        raise ValueError(f"bias must have shape ({x.shape[1]},), got {tuple(bias.shape)}")
    if x.shape[0] != batch.num_tokens:
        raise ValueError(f"x has {x.shape[0]} tokens but the batch has {batch.num_tokens}")
    halo = conv_halo(batch, weight.shape[1]).numel() if batch.num_context else 0
    if (context_x is None) != (halo == 0):
        raise ValueError(
            f"the batch's conv reads {halo} context tokens (conv_halo): pass their inputs as context_x iff it has any"
        )
    if context_x is not None and context_x.shape != (halo, x.shape[1]):
        raise ValueError(f"context_x must have shape ({halo}, {x.shape[1]}) (conv_halo), got {tuple(context_x.shape)}")


def conv_call(kind: str, x: torch.Tensor, weight: torch.Tensor, **_) -> Call:
    """The :class:`~harts_hf.ops.backends.Call` of a conv over x [N, D] with weight [D, W]."""
    return Call(kind, x.device, width=weight.shape[1])


@register("conv", "torch", tables=lambda call: (ConvHaloTable(call.width), ConvGatherTable(call.width)))
def tree_causal_conv1d_torch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    batch: TreeBatch,
    *,
    activation: str | None = None,
    context_x: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pure-PyTorch tree causal conv (see :func:`tree_causal_conv1d`)."""
    check_conv_args(x, weight, bias, batch, context_x, activation)
    parts = (x,) if context_x is None else (context_x, x)
    xa = torch.cat((*parts, x.new_zeros(1, x.shape[1]))).to(weight.dtype)  # [H + N + 1, D]
    table = batch.cached(ConvGatherTable(weight.shape[1]))
    out = _Conv.apply(xa, weight, table)
    if bias is not None:
        out = out + bias
    if activation is not None:
        out = ACT2FN[activation](out)
    return out.to(x.dtype)


@dispatch("conv", conv_call, autocast_casts=("x", "weight", "bias", "context_x"))
def tree_causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    batch: TreeBatch,
    *,
    activation: str | None = None,
    context_x: torch.Tensor | None = None,
) -> torch.Tensor:
    """Depthwise causal conv of every piece token over its W-1 ancestors (zero past a root).

    Args:
        x: [N, D] inputs of the batch's own tokens, DFS order.
        weight: [D, W] depthwise kernel, as transformers' ``causal_conv1d_fn`` takes it
            (``weight[:, W-1]`` multiplies the token itself).
        bias: [D] or None.
        batch: the microbatch's tree metadata.
        activation: an ``ACT2FN`` name ("silu") or None.
        context_x: [H, D] inputs of the halo tokens (``conv_halo(batch, W)``: the context tokens
            within W - 1 steps of a piece token, from an earlier microbatch); gradients flow into it.

    Returns:
        [N, D] in x's dtype (computed in weight's dtype, like ``causal_conv1d_fn``; under autocast
        all in the autocast dtype, as ``F.conv1d`` there).
    """

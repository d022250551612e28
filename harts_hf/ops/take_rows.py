"""Row gathers whose backward stays on the fast path of CPU ``index_add_``.

The tree driver gathers rows (tokens into chunk slots, states into paths, chunks into state requests),
and autograd turns each ``index_select`` into a zero-filled ``index_add_`` in backward. On CPU that add
runs over contiguous rows only when the incoming gradient is contiguous; a gradient that leaves a
``bmm`` transposed (``keys.transpose(-1, -2) @ values`` in a state request) falls back to an
element-wise scatter, several times slower (8 ms for 155 chunks of 4 x 64 x 64 at bench-ops scale
0.02). :func:`take_rows` is ``x.index_select(0, index)`` whose backward makes the gradient contiguous
once and adds it as one [rows, features] block.
"""

from __future__ import annotations

import torch

__all__ = ["take_rows"]


class _TakeRows(torch.autograd.Function):
    """``x.index_select(0, index)``; backward: one contiguous 2-D ``index_add_``."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(index)
        ctx.shape = x.shape
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (index,) = ctx.saved_tensors
        rows = grad.contiguous().view(grad.shape[0], -1)  # [n, features]
        dx = rows.new_zeros(ctx.shape[0], rows.shape[1]).index_add_(0, index, rows)
        return dx.view(ctx.shape), None


def take_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x.index_select(0, index)`` (``index`` 1-D long, repeats allowed) with a fast CPU backward."""
    if not (x.requires_grad and torch.is_grad_enabled()):
        return x.index_select(0, index)
    return _TakeRows.apply(x, index)

"""What the fla backend's zero-extra-round segment kernels share (``diagonal.py``, ``delta.py``):
fla's chunk size, fla's lower-level functions imported on first use (importing harts_hf never imports
triton), and the autograd Function around a kind's forward / backward sequence of fla calls.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...chunking import CHUNK_SIZE
from ..precision import without_autocast
from . import _compat as fla

__all__ = ["BT", "fla_chunks"]

BT = CHUNK_SIZE  # fla's chunk size (its kernels are written for 64-token chunks): per-chunk states sit on this grid


class _FlaChunks(torch.autograd.Function):
    """o, per-chunk start states and final states of one varlen call, with gradients into all three.
    ``steps`` = (forward, backward): ``forward(ctx, *args) -> (o, h_chunks, h_final)``, ``backward(ctx,
    do, dh_ext, dht)`` -> the gradients of the leading tensor arguments (the rest get None)."""

    @staticmethod
    def forward(ctx, steps: tuple[Callable, Callable], *args):
        ctx.set_materialize_grads(False)
        ctx.backward_steps, ctx.num_args = steps[1], len(args)
        return fla.input_guard(steps[0])(ctx, *args)  # contiguous inputs, kernels on the inputs' device

    @staticmethod
    @without_autocast
    def backward(ctx, do: torch.Tensor | None, dh_ext: torch.Tensor | None, dht: torch.Tensor | None):
        grads = fla.input_guard(ctx.backward_steps)(ctx, do, dh_ext, dht)
        return None, *grads, *[None] * (ctx.num_args - len(grads))


def fla_chunks(forward: Callable, backward: Callable, *args) -> tuple[torch.Tensor, ...]:
    """``forward(ctx, *args)`` with ``backward`` as its gradient (see :class:`_FlaChunks`)."""
    return _FlaChunks.apply((forward, backward), *args)

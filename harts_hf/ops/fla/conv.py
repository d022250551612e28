"""The ``fla`` backend of the tree causal conv: fla's ``causal_conv1d`` over the tree's runs.

In DFS order a token's first child is the next token, so a piece splits into *runs*: maximal
spans of tokens each the child of the one before (unlike a tree chain, a run goes on through a
branch point into its first child; a run starts at the piece's first token and
at every token whose parent is not the previous token: roots, second and later children). ONE
varlen fla call convolves every run (``cu_seqlens`` = run bounds), x passed as it is (a
piece with context concatenates ``context_x``, its halo rows, and x once, for the gather). A
run's conv state is the input of its first token's W-1 nearest ancestors (zero past a root;
halo tokens of the context supply them in a piece), gathered as fla's ``initial_state``
[S, D, W] (slot 0 unused, slot c = the (W-c)-th ancestor); fla's backward returns its gradient
(dh0), which autograd scatters into the ancestors' rows of x and ``context_x``.

A *fragmented* batch (mean run shorter than ``GATHER_BELOW_MEAN_RUN`` tokens) runs the torch
gather (``..conv``) instead (its runs table is None, and building it builds the gather table): fla gives each run at least one 64-token program and
the initial-state gather copies W-1 rows per run (as many as x holds, or more), while the
gather's W index passes do not depend on the tree's shape. Agentic and GRPO trees have runs of hundreds
of tokens and take the fla kernel; 16 is an estimate, timed by ``scripts/gpu_check.py``.
Activations other than silu run after the kernel.

Legend: N piece tokens, Nc context tokens, Nk = Nc + N (combined space), H halo tokens
(``conv_halo``), S runs, D channels, W conv width.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.activations import ACT2FN

from ..backends import register
from ..conv import ConvGatherTable, ConvHaloTable, check_conv_args, local_rows, tree_causal_conv1d_torch
from ..tree_batch import Table, TreeBatch
from . import _compat as fla
from .backend import fla_available, runs_on

__all__ = [
    "GATHER_BELOW_MEAN_RUN",
    "Runs",
    "RunsTable",
    "mean_run",
    "runs_of",
    "tree_causal_conv1d_fla",
    "uses_gather",
]

GATHER_BELOW_MEAN_RUN = 16.0
_FLA_ACTIVATIONS = ("silu", "swish")


@dataclass(frozen=True, eq=False)
class Runs:
    """The runs of a batch (module docstring), for one conv width.

    Args:
        cu_seqlens: [S + 1] int32 run bounds in the piece's token order, on the batch's device.
        cu_seqlens_cpu: the same on the CPU (fla reads it without a device sync).
        halo: [S, W - 1] row of each run's (W-1-c)-th ancestor in column c among ``[halo tokens,
            piece tokens]`` (``conv.local_rows``); H + N past a root.
    """

    cu_seqlens: torch.Tensor
    cu_seqlens_cpu: torch.Tensor
    halo: torch.Tensor


@dataclass(frozen=True)
class RunStartsTable(Table):
    """[S] combined index of every run's first token (module docstring)."""

    def build(self, batch: TreeBatch) -> torch.Tensor:
        own = torch.arange(batch.num_context, batch.prev.numel(), device=batch.device)
        starts = batch.prev[batch.num_context :] != own - 1
        starts[0] = True  # the piece's first token starts a run even under a context parent
        return own[starts]


@dataclass(frozen=True)
class RunsTable(Table):
    """The :class:`Runs` of a width-``width`` conv; None for a fragmented batch (:func:`uses_gather`),
    whose calls run the torch gather: its table is built with this one."""

    width: int

    def build(self, batch: TreeBatch) -> Runs | None:
        if uses_gather(batch):
            batch.cached(ConvGatherTable(self.width))
            return None
        return _build(batch, self.width)


def _run_starts(batch: TreeBatch) -> torch.Tensor:
    """[S] combined index of every run's first token (module docstring), derived once per batch."""
    return batch.cached(RunStartsTable())


def _build(batch: TreeBatch, width: int) -> Runs:
    nc, nk = batch.num_context, batch.prev.numel()
    first = _run_starts(batch)
    cu = torch.cat((first - nc, first.new_tensor([nk - nc]))).to(torch.int32)
    up = torch.where(batch.prev >= 0, batch.prev, nk)
    up = torch.cat((up, up.new_tensor([nk])))  # Nk (past a root) is its own parent
    halo = torch.empty(first.numel(), width - 1, dtype=torch.long, device=batch.device)
    cur = first
    for c in range(width - 2, -1, -1):  # one vectorised pointer jump per tap
        cur = up[cur]
        halo[:, c] = cur
    return Runs(cu, cu.cpu(), local_rows(batch, width, halo))


def runs_of(batch: TreeBatch, width: int) -> Runs | None:
    """The runs of ``batch`` for conv width ``width`` (None: fragmented), derived once per batch."""
    return batch.cached(RunsTable(width))


def mean_run(batch: TreeBatch) -> float:
    """Mean run length of ``batch`` in tokens."""
    return batch.num_tokens / _run_starts(batch).numel()


def uses_gather(batch: TreeBatch) -> bool:
    """Whether a call on ``batch`` runs the torch gather rather than fla's kernel (module docstring)."""
    return mean_run(batch) < GATHER_BELOW_MEAN_RUN


def _initial_states(src: torch.Tensor, halo: torch.Tensor) -> torch.Tensor:
    """[S, D, W] fla initial states: slot 0 zero, slots 1.. the halo rows of ``src`` [H + N, D]."""
    past_root = halo >= src.shape[0]
    rows = src[halo.clamp(max=src.shape[0] - 1)].masked_fill(past_root[..., None], 0)  # [S, W-1, D]
    return torch.cat((rows.new_zeros(rows.shape[0], 1, rows.shape[2]), rows), dim=1).transpose(1, 2).contiguous()


@register(
    "conv",
    "fla",
    tables=lambda call: (ConvHaloTable(call.width), RunsTable(call.width)),
    available=fla_available,
    accepts=lambda call: runs_on(call.device),
)
def tree_causal_conv1d_fla(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    batch: TreeBatch,
    *,
    activation: str | None = None,
    context_x: torch.Tensor | None = None,
) -> torch.Tensor:
    """fla backend of :func:`harts_hf.ops.tree_causal_conv1d` (same arguments and result)."""
    check_conv_args(x, weight, bias, batch, context_x, activation)
    runs = runs_of(batch, weight.shape[1])
    if runs is None:  # fragmented
        return tree_causal_conv1d_torch(x, weight, bias, batch, activation=activation, context_x=context_x)
    xw = x.to(weight.dtype)  # [N, D], computed in weight's dtype like the torch backend
    src = xw if context_x is None else torch.cat((context_x.to(weight.dtype), xw))  # [H + N, D]
    in_kernel = activation if activation in _FLA_ACTIVATIONS else None
    y, _ = fla.causal_conv1d(
        xw.unsqueeze(0),
        weight,
        bias,
        None,
        _initial_states(src, runs.halo),
        False,
        in_kernel,
        cu_seqlens=runs.cu_seqlens,
        cu_seqlens_cpu=runs.cu_seqlens_cpu,
    )
    y = y[0]  # [N, D]
    if activation is not None and in_kernel is None:
        y = ACT2FN[activation](y)
    return y.to(x.dtype)

"""The ``fla`` backend of the linear-attention tree ops, registered in ``..backends``.

Available when fla and triton import and either CUDA is present or Triton's interpreter is on
(``TRITON_INTERPRET=1``, CPU tests); it accepts calls whose tensors sit where the kernels run and
whose chunk grid is fla's (a multiple of 64). Each kind runs the exact *cut* layout
(``waves.py``: one extra wave per needed interior boundary on a chain), reported once per kind
in the log: ``WAVES_LAYOUT`` says which layout each kind uses.

Legend: N piece tokens, Hk key heads, H value heads, K key dim, V value dim.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
from collections.abc import Mapping

import torch

from ..backends import register
from ..tree_batch import TreeBatch
from .driver import run_waves
from .public_ops import SEGMENT_OPS

__all__ = ["FLA_CHUNK", "WAVES_LAYOUT", "fla_available", "interpreting"]

logger = logging.getLogger(__name__)
FLA_CHUNK = 64
# kind -> "cut" (exact fallback, extra waves) or "rounds" (zero extra rounds).
WAVES_LAYOUT = {"gated_delta": "cut", "kda": "cut", "gla": "cut", "simple_gla": "cut"}


def interpreting() -> bool:
    """Triton's CPU interpreter is on (it must be set before triton is imported)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.cache
def _importable() -> bool:
    return all(importlib.util.find_spec(name) is not None for name in ("fla", "triton"))


def fla_available() -> bool:
    """fla + triton installed, and a device to run them (CUDA, or the interpreter on CPU)."""
    return _importable() and (interpreting() or torch.cuda.is_available())


def _accepts(q: torch.Tensor, *args, chunk_size: int = 64, **kwargs) -> bool:
    return (q.is_cuda or interpreting()) and chunk_size % FLA_CHUNK == 0


def _run(kind: str, batch: TreeBatch, chunk_size: int, *, l2: bool = False, **inputs) -> tuple:
    cut = WAVES_LAYOUT[kind] == "cut"
    if cut:
        logger.info("harts-hf: fla %s uses the cut layout (exact, extra sequential waves)", kind)
    kernel = functools.partial(SEGMENT_OPS[kind], l2=l2)
    return run_waves(kernel, batch, chunk_size, cut=cut, **inputs)


def _scale(k: torch.Tensor, scale: float | None) -> float:
    return k.shape[-1] ** -0.5 if scale is None else scale


@register("gated_delta", "fla", available=fla_available, accepts=_accepts)
def tree_gated_delta_rule_fla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    batch: TreeBatch,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    chunk_size: int = 64,
    context: Mapping[str, torch.Tensor] | None = None,
    initial_states: torch.Tensor | None = None,
    state_out_tokens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fla backend of :func:`harts_hf.ops.tree_gated_delta_rule`."""
    return _run(
        "gated_delta",
        batch,
        chunk_size,
        l2=use_qk_l2norm,
        q=q,
        k=k,
        v=v,
        g=g,
        beta=beta,
        scale=_scale(k, scale),
        context=context,
        initial_states=initial_states,
        state_out_tokens=state_out_tokens,
    )


@register("kda", "fla", available=fla_available, accepts=_accepts)
def tree_kda_fla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    batch: TreeBatch,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    chunk_size: int = 64,
    context: Mapping[str, torch.Tensor] | None = None,
    initial_states: torch.Tensor | None = None,
    state_out_tokens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fla backend of :func:`harts_hf.ops.tree_kda`."""
    return _run(
        "kda",
        batch,
        chunk_size,
        l2=use_qk_l2norm,
        q=q,
        k=k,
        v=v,
        g=g,
        beta=beta,
        scale=_scale(k, scale),
        context=context,
        initial_states=initial_states,
        state_out_tokens=state_out_tokens,
    )


@register("gla", "fla", available=fla_available, accepts=_accepts)
def tree_gla_fla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    batch: TreeBatch,
    *,
    scale: float | None = None,
    chunk_size: int = 64,
    context: Mapping[str, torch.Tensor] | None = None,
    initial_states: torch.Tensor | None = None,
    state_out_tokens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fla backend of :func:`harts_hf.ops.tree_gla`."""
    return _run(
        "gla",
        batch,
        chunk_size,
        q=q,
        k=k,
        v=v,
        g=g,
        beta=None,
        scale=_scale(k, scale),
        context=context,
        initial_states=initial_states,
        state_out_tokens=state_out_tokens,
    )


@register("simple_gla", "fla", available=fla_available, accepts=_accepts)
def tree_simple_gla_fla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None,
    batch: TreeBatch,
    *,
    g_gamma: torch.Tensor | None = None,
    scale: float | None = None,
    chunk_size: int = 64,
    context: Mapping[str, torch.Tensor] | None = None,
    initial_states: torch.Tensor | None = None,
    state_out_tokens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fla backend of :func:`harts_hf.ops.tree_simple_gla`; a constant ``g_gamma`` becomes a
    per-token g so that tail padding stays neutral."""
    if (g is None) == (g_gamma is None):
        raise ValueError("pass exactly one of g (per-token decay) and g_gamma (constant per-head decay)")
    heads = v.shape[1]
    per_token = lambda gates, n: gates.float() if g_gamma is None else g_gamma.float().expand(n, heads)
    if context is not None:
        context = {**context, "g": per_token(context.get("g"), context["v"].shape[0])}
    return _run(
        "simple_gla",
        batch,
        chunk_size,
        q=q,
        k=k,
        v=v,
        g=per_token(g, v.shape[0]),
        beta=None,
        scale=_scale(k, scale),
        context=context,
        initial_states=initial_states,
        state_out_tokens=state_out_tokens,
    )

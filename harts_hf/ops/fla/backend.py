"""The ``fla`` backend of the linear-attention tree ops, registered in ``..backends``.

Available when fla and triton import and either CUDA is present or Triton's interpreter is on
(``TRITON_INTERPRET=1``, CPU tests); it accepts calls whose tensors sit where the kernels run and
whose chunk grid is fla's (a multiple of 64). ``WAVES_LAYOUT`` says which layout of
``waves.py`` each kind runs: every kind the zero-extra-round layout, the diagonal-decay kinds
(GLA, simple GLA) on ``diagonal.py``'s kernels, the delta rules (GDN, KDA) on ``delta.py``'s; the
exact *cut* layout on fla's public ops (one extra wave per needed interior boundary on a chain,
logged once per kind) stays selectable per kind.

One mechanism serves every kind (as ``linear_attention.run_tree_kind`` serves the torch kinds):
a kind's fla implementation takes the signature of its torch backend, bound per call, so the
public op's arguments reach :func:`.driver.run_waves` unchanged; a kind declares only its torch
backend and, if it needs one, a rewrite of the bound arguments (simple GLA's constant decay).
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import logging
import os
from collections.abc import Callable

import torch

from ..backends import Call, register
from ..gated_delta import tree_gated_delta_rule_torch
from ..gla import tree_gla_torch, tree_simple_gla_torch
from ..kda import tree_kda_torch
from ..linear_attention import grid_tables
from ..tree_batch import Table
from . import _compat as fla
from .common import BT as FLA_CHUNK
from .delta import DeltaChunkOp
from .diagonal import DiagonalChunkOp
from .driver import run_waves
from .public_ops import SEGMENT_OPS
from .waves import WavesTable

__all__ = [
    "FLA_CHUNK",
    "ROUNDS_OPS",
    "WAVES_LAYOUT",
    "fla_available",
    "interpreting",
    "tree_gated_delta_rule_fla",
    "tree_gla_fla",
    "tree_kda_fla",
    "tree_simple_gla_fla",
]

logger = logging.getLogger(__name__)
MIN_GPU_HEAD_DIM = 16  # Triton's tl.dot wants every tile dimension >= 16 on a GPU
# kind -> "cut" (exact fallback, extra waves; SEGMENT_OPS) or "rounds" (zero extra rounds; ROUNDS_OPS).
WAVES_LAYOUT = {"gated_delta": "rounds", "kda": "rounds", "gla": "rounds", "simple_gla": "rounds"}
# kind -> segment kernel that returns per-chunk states (``cut=False``); tests swap entries.
ROUNDS_OPS = {
    "gated_delta": DeltaChunkOp(),
    "kda": DeltaChunkOp(),
    "gla": DiagonalChunkOp(per_channel=True),
    "simple_gla": DiagonalChunkOp(per_channel=False),
}

Arguments = dict[str, object]


def interpreting() -> bool:
    """Triton's CPU interpreter is on (it must be set before triton is imported)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.cache
def _importable() -> bool:
    return all(importlib.util.find_spec(name) is not None for name in ("fla", "triton")) and fla.fla_checked()


def fla_available() -> bool:
    """fla (the release ``_compat`` names) + triton installed, and a device to run them (CUDA, or the
    interpreter on CPU)."""
    return _importable() and (interpreting() or torch.cuda.is_available())


def runs_on(device: torch.device) -> bool:
    """fla's kernels can take tensors on ``device``: CUDA, or anywhere under the interpreter."""
    return device.type == "cuda" or interpreting()


def _accepts(call: Call) -> bool:
    """fla's chunk grid, and on a GPU head dims its kernels' ``tl.dot`` tiles take (Jamba's Mamba v1
    runs as GLA with V = 1: the torch backend serves it)."""
    on_gpu = call.device.type == "cuda"
    dims_fit = not on_gpu or min(call.key_dim, call.value_dim) >= MIN_GPU_HEAD_DIM
    return runs_on(call.device) and call.chunk_size % FLA_CHUNK == 0 and dims_fit


# Kinds whose backward runs fla's gated ``chunk_bwd_dqkwg``, which fla 0.6.0 refuses on Hopper with
# Triton 3.4 - 3.7.0 (wrong results there, fla issue #640).
GATED_DQKWG_KINDS = ("gated_delta", "simple_gla")


@functools.cache
def fla_refuses_gated_backward() -> bool:
    """fla's own test of that Triton bug on this machine (warned once: those kinds fall back to torch)."""
    refuses = bool(fla.IS_NVIDIA_HOPPER.get() and fla.TRITON_ABOVE_3_4_0.get() and not fla.TRITON_ABOVE_3_7_1.get())
    if refuses:
        logger.warning(
            "harts-hf: fla refuses gated chunk backward with this Triton on Hopper (fla #640): %s run on the "
            "torch backend; install triton>=3.7.1 for fla's kernels",
            ", ".join(GATED_DQKWG_KINDS),
        )
    return refuses


def _accepts_kind(kind: str) -> Callable[[Call], bool]:
    """:func:`_accepts`, and for :data:`GATED_DQKWG_KINDS` a Triton fla runs them correctly with."""
    gated = kind in GATED_DQKWG_KINDS
    return lambda call: _accepts(call) and not (gated and call.device.type == "cuda" and fla_refuses_gated_backward())


def _cut(kind: str) -> bool:
    """Whether ``kind`` runs the cut layout (``WAVES_LAYOUT``)."""
    return WAVES_LAYOUT[kind] == "cut"


def _tables(kind: str) -> Callable[[Call], tuple[Table, ...]]:
    """The tables :func:`.driver.run_waves` reads for ``kind``."""
    return lambda call: (*grid_tables(call), WavesTable(call.chunk_size, _cut(kind)))


@functools.cache
def _announce(kind: str) -> None:
    if _cut(kind):
        logger.info("harts-hf: fla %s uses the cut layout (exact, extra sequential waves)", kind)


def _fla_kind(kind: str, torch_fn: Callable, prepare: Callable[[Arguments], Arguments] | None = None) -> Callable:
    """Register and return the fla implementation of ``kind``, with ``torch_fn``'s signature.

    ``prepare`` rewrites the bound arguments before they reach the driver; what it must leave
    (beyond q, k, v, g, beta, context, initial_states) are ``batch``,
    ``chunk_size``, ``scale`` and the delta rules' ``use_qk_l2norm``.
    """
    signature = inspect.signature(torch_fn)

    def tree_op_fla(*args, **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
        call = signature.bind(*args, **kwargs)
        call.apply_defaults()
        a = dict(call.arguments) if prepare is None else prepare(dict(call.arguments))
        batch, chunk_size = a.pop("batch"), a.pop("chunk_size")
        l2 = a.pop("use_qk_l2norm", False)
        a["scale"] = a["k"].shape[-1] ** -0.5 if a["scale"] is None else a["scale"]
        a.setdefault("beta", None)
        _announce(kind)
        cut = _cut(kind)
        kernel = functools.partial((SEGMENT_OPS if cut else ROUNDS_OPS)[kind], l2=l2)
        return run_waves(kernel, batch, chunk_size, cut=cut, **a)

    tree_op_fla.__name__ = tree_op_fla.__qualname__ = torch_fn.__name__.removesuffix("_torch") + "_fla"
    tree_op_fla.__doc__ = f"fla backend of the ``{kind}`` tree op (arguments: :func:`{torch_fn.__name__}`)."
    tree_op_fla.__signature__ = signature
    return register(kind, "fla", tables=_tables(kind), available=fla_available, accepts=_accepts_kind(kind))(
        tree_op_fla
    )


def _per_token_decay(a: Arguments) -> Arguments:
    """Simple GLA: a constant ``g_gamma`` becomes a per-token g, so that tail padding (g = 0)
    stays neutral; g is fp32 like the torch backend's."""
    g, g_gamma, v = a["g"], a.pop("g_gamma"), a["v"]
    if (g is None) == (g_gamma is None):
        raise ValueError("pass exactly one of g (per-token decay) and g_gamma (constant per-head decay)")
    heads = v.shape[1]
    decay = lambda gates, n: gates.float() if g_gamma is None else g_gamma.float().expand(n, heads)
    a["g"] = decay(g, v.shape[0])
    context = a["context"]
    if context is not None:
        a["context"] = {**context, "g": decay(context.get("g"), context["v"].shape[0])}
    return a


tree_gated_delta_rule_fla = _fla_kind("gated_delta", tree_gated_delta_rule_torch)
tree_kda_fla = _fla_kind("kda", tree_kda_torch)
tree_gla_fla = _fla_kind("gla", tree_gla_torch)
tree_simple_gla_fla = _fla_kind("simple_gla", tree_simple_gla_torch, prepare=_per_token_decay)

"""Zero-extra-round segment kernels for the diagonal-decay kinds (GLA; simple GLA, which also
serves Mamba2-SSD and lightning attention), built from fla's lower-level chunk functions.

In the ``cut=False`` layout (``waves.py``) a child path starts where its parent's call computes
an interior chunk-start state, so the kernel must return every chunk's start state and take
their gradients back. fla's forward already computes them (``chunk_fwd_h``); its backward takes
a state gradient only at a sequence's end (``dht``). With diagonal decay the state-gradient
recurrence is linear in what enters it, so the children's share is a separate recurrence through
the chunk decays alone, added to fla's ``dh`` before fla's dq/dk/dv/dg kernels read it (their dg
terms in h * dh then see the total)::

    h_{c+1} = a_c * h_c + (chunk c's k/v term),   a_c = exp(G_c), G_c chunk c's total log-decay
    Y_c = dh_ext_c + a_c * Y_{c+1},  Y_NT = 0     (dh_ext_c: gradient children put on h_c)
    dh_c += Y_{c+1}  (fla's dh_c: gradient of chunk c's END state),  dh0 += Y_0

Everything else is fla's own sequence of calls (``chunk_gla_fwd`` / ``chunk_gla_bwd``,
``chunk_simple_gla_fwd`` / ``chunk_simple_gla_bwd``): gates as chunk-local cumulative sums in
log2 units, h recomputed in backward, fp32 states (``common.py``: fla imported on first use); its
two state kernels go through ``STATE_KERNELS`` so CPU tests
can run every other function in Triton's interpreter, which cannot run those two.

Legend: T packed tokens (batch 1, varlen), S sequences, NT chunks (all sequences), H heads,
K key dim, V value dim, BT fla's chunk (64).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import _compat as fla
from .common import BT, fla_chunks
from .waves import ChunkSteps, Wave

__all__ = ["STATE_KERNELS", "DiagonalChunkOp", "inject_state_grads"]

T = torch.Tensor


# fla's state kernels (Triton's interpreter cannot run them): tests swap in PyTorch references.
STATE_KERNELS = {
    "fwd_h": fla.chunk_fwd_h,
    "bwd_dh": fla.chunk_bwd_dh,
}


def inject_state_grads(dh: T, dh0: T, dh_ext: T, gc: T, steps: ChunkSteps) -> None:
    """Adds the gradients children put on chunk-start states to fla's state gradients, in place
    (the module docstring's Y recurrence), one batched step per local chunk index.

    dh [NT, H, K, V] fp32: fla's gradient of each chunk's end state; dh0 [S, H, K, V] fp32;
    dh_ext [NT, H, K, V]: gradient of each chunk's start state (fla's ``h`` rows); gc [T, H] or
    [T, H, K]: chunk-local cumulative log2 gates (at a chunk's last token: its total, G_c / ln 2);
    ``steps``: the call's chunks in step-major order (compiled with its wave).
    """
    order = steps.order
    y = dh_ext[order].float()  # [NT, H, K, V] step-major, becomes Y
    a = torch.exp2(gc[steps.last].float())  # [NT, H] or [NT, H, K]
    a = a.reshape(*a.shape[:2], -1, 1)  # [NT, H, K or 1, 1]
    off = steps.offsets
    for c in range(len(off) - 3, -1, -1):
        n = off[c + 2] - off[c + 1]  # sequences with a chunk c + 1: the leading ones of step c
        y[off[c] : off[c] + n].addcmul_(a[off[c] : off[c] + n], y[off[c + 1] : off[c + 1] + n])
    dh.index_add_(0, order[off[1] :] - 1, y[off[1] :])
    dh0.index_add_(0, steps.first_rank, y[: off[1]])


def _forward(ctx, q: T, k: T, v: T, g: T, h0: T, wave: Wave, scale: float, per_channel: bool) -> tuple[T, T, T]:
    """fla's chunk_gla_fwd / chunk_simple_gla_fwd, keeping the fp32 chunk states it would drop."""

    cu = wave.cu_seqlens
    idx = fla.prepare_chunk_indices(cu, BT, cu_seqlens_cpu=wave.cu_seqlens_cpu)
    common = {"cu_seqlens": cu, "chunk_size": BT}
    gc = fla.chunk_local_cumsum(
        g, BT, scale=fla.RCP_LN2.get(), cu_seqlens=cu, chunk_indices=idx
    )  # [1, T, H(, K)] log2, fp32
    gate = {"gk": gc} if per_channel else {"g": gc}
    h, ht = STATE_KERNELS["fwd_h"](k=k, v=v, **gate, h0=h0, output_final_state=True, states_in_fp32=True, **common)
    hk = h.to(k.dtype)  # [1, NT, H, K, V]: fla's forward keeps h in k's dtype for the output
    if per_channel:
        A = fla.chunk_gla_fwd_intra_gk(q=q, k=k, g=gc, scale=scale, chunk_indices=idx, **common)
        o = fla.chunk_gla_fwd_o_gk(q=q, v=v, g=gc, A=A, h=hk, scale=scale, chunk_indices=idx, **common)
    else:
        A = None
        o = fla.chunk_fwd_o(q=q, k=k, v=v, h=hk, g=gc, scale=scale, chunk_indices=idx, **common)
    ctx.save_for_backward(q, k, v, gc, h0, A, idx)
    ctx.wave, ctx.scale, ctx.per_channel, ctx.g_dtype = wave, scale, per_channel, g.dtype
    return o, h[0], ht


def _backward(ctx, do: T | None, dh_ext: T | None, dht: T | None) -> tuple[T, T, T, T, T]:
    """fla's chunk_gla_bwd / chunk_simple_gla_bwd, with the children's gradients added to dh and
    dh0 before the dq/dk/dv/dg kernels read them."""
    q, k, v, gc, h0, A, idx = ctx.saved_tensors
    wave, scale = ctx.wave, ctx.scale
    common = {"cu_seqlens": wave.cu_seqlens, "chunk_size": BT}
    do = torch.zeros_like(v) if do is None else do  # only states were differentiated
    gate = {"gk": gc} if ctx.per_channel else {"g": gc}
    h, _ = STATE_KERNELS["fwd_h"](k=k, v=v, **gate, h0=h0, output_final_state=False, states_in_fp32=True, **common)
    # dh [1, NT, H, K, V]: gradient of each chunk's end state; dh0 [S, H, K, V]
    dh, dh0 = STATE_KERNELS["bwd_dh"](
        q=q, k=k, v=v, do=do, h0=h0, dht=dht, scale=scale, **gate, states_in_fp32=True, **common
    )
    if dh_ext is not None:
        inject_state_grads(dh[0], dh0, dh_ext, gc[0], wave.steps)
    if ctx.per_channel:
        dv = fla.chunk_gla_bwd_dv(k=k, g=gc, A=A, do=do, dh=dh, chunk_indices=idx, **common)
        dA = fla.chunk_gla_bwd_dA(v=v, do=do, scale=scale, chunk_indices=idx, **common)
        dq, dk = fla.chunk_gla_bwd_dqk_intra(q=q, k=k, g=gc, dA=dA, chunk_indices=idx, **common)
        dq, dk, dg = fla.chunk_gla_bwd_dqkg(
            q=q, k=k, v=v, h=h, g=gc, do=do, dh=dh, dq=dq, dk=dk, scale=scale, chunk_indices=idx, **common
        )
    else:
        dq, dk, _, dg = fla.chunk_bwd_dqkwg(
            q=q, k=k, v=v, do=do, h=h, dh=dh, g=gc, scale=scale, chunk_indices=idx, **common
        )
        dv = fla.chunk_bwd_dv(q=q, k=k, do=do, dh=dh, g=gc, scale=scale, chunk_indices=idx, **common)
        dg = fla.chunk_local_cumsum(dg, BT, reverse=True, cu_seqlens=wave.cu_seqlens, chunk_indices=idx)
    return dq.to(q), dk.to(k), dv.to(v), dg.to(ctx.g_dtype), dh0


@dataclass(frozen=True)
class DiagonalChunkOp:
    """GLA (``per_channel``: g [1, T, H, K]) or simple GLA (g [1, T, H]) as a segment kernel of
    the ``cut=False`` layout (``driver.py`` signature; ``beta`` and ``l2`` belong to the delta
    rules): also returns the start state of each of fla's 64-token chunks, h_chunks
    [NT, H, K, V] fp32, differentiable."""

    per_channel: bool

    def __call__(
        self, q: T, k: T, v: T, g: T, beta: T | None, h0: T, wave: Wave, *, scale: float, chunks: bool, l2: bool = False
    ) -> tuple[T, T | None, T]:
        o, h, ht = fla_chunks(_forward, _backward, q, k, v, g, h0, wave, scale, self.per_channel)
        return o, h if chunks else None, ht

"""Zero-extra-round segment kernels for the delta rules (GDN: per-head decay; KDA: per-channel
decay), built from fla's lower-level chunk functions, with the state-gradient recurrence on our
kernel (``delta_state_grad.py``).

In the ``cut=False`` layout (``waves.py``) a child path starts where its parent's call computes
an interior chunk-start state, so the kernel must return every chunk's start state and take
their gradients back. fla's forward computes them (``chunk_gated_delta_rule_fwd_h``); its
backward (``chunk_gated_delta_rule_bwd_dhu``) takes a state gradient only at a sequence's end.
Unlike the diagonal kinds (``diagonal.py``), the delta rule's reverse recurrence also runs
through ``dv2`` (the gradient of ``v_new = u - w h``), so the children's share cannot be added
afterwards: our kernel runs the whole recurrence, loading the children's gradients at every
interior chunk boundary.

Everything else is fla's own sequence of calls (``ChunkGatedDeltaRuleFunction``,
``ChunkKDAFunction`` without its optional in-kernel gate / beta activations): q/k l2norm by
fla's ``l2norm_fwd`` / ``l2norm_bwd`` inside this Function (as fla's op does), gates as
chunk-local cumulative sums in log2 units (our kernel takes natural log: times ln 2), WY
representation and h recomputed in backward. fla's state-forward wrapper stores h in k's dtype;
``fwd_h_fp32`` launches the same fla kernel into an fp32 buffer, so children start from fp32
states (the kernel's registers are fp32 either way). It goes through ``STATE_KERNELS``: Triton's
interpreter cannot run it, CPU tests swap in a PyTorch reference and run everything else.

Legend: T packed tokens (batch 1, varlen), S sequences, NT chunks (all sequences), H heads (q/k
already expanded to v's heads by the driver), K key dim, V value dim, BT fla's chunk (64).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import _compat as fla
from .common import BT, fla_chunks
from .waves import Wave

__all__ = ["STATE_KERNELS", "DeltaChunkOp", "fwd_h_fp32"]

T = torch.Tensor


def fwd_h_fp32(
    k: T, w: T, u: T, g: T, initial_state: T, output_final_state: bool, cu_seqlens: T, chunk_indices: T, chunk_size: int
) -> tuple[T, T, T | None]:
    """fla's ``chunk_gated_delta_rule_fwd_h`` (its wrapper's exact launch) with h [1, NT, H, K, V]
    in fp32: (h, v_new [1, T, H, V], final states [S, H, K, V] fp32 or None). g [1, T, H] (GDN)
    or [1, T, H, K] (KDA, fla's ``gk``; k then already gated, fla's ``kg``)."""
    import triton

    _, length, H, K = k.shape
    V, S, NT = u.shape[-1], cu_seqlens.numel() - 1, chunk_indices.shape[0]
    h = k.new_empty(1, NT, H, K, V, dtype=torch.float32)
    ht = k.new_zeros(S, H, K, V, dtype=torch.float32) if output_final_state else None
    v_new = torch.empty_like(u)
    fla.delta_fwd_h_kernel.get()[lambda meta: (triton.cdiv(V, meta["BV"]) * S * H,)](
        k=k,
        v=u,
        w=w,
        v_new=v_new,
        g=None if g.dim() == 4 else g,
        gk=g if g.dim() == 4 else None,
        h=h,
        h0=initial_state,
        ht=ht,
        cu_seqlens=cu_seqlens,
        chunk_offsets=fla.prepare_chunk_offsets(cu_seqlens, chunk_size),
        T=length,
        H=H,
        HV=H,
        K=K,
        V=V,
        BT=chunk_size,
        STATE_V_FIRST=False,
    )
    return h, v_new, ht


# fla's state-forward kernel (Triton's interpreter cannot run it): tests swap in a PyTorch reference.
STATE_KERNELS = {"fwd_h": fwd_h_fp32}


def _forward(ctx, q: T, k: T, v: T, g: T, beta: T, h0: T, wave: Wave, scale: float, l2: bool) -> tuple[T, T, T]:
    """fla's ChunkGatedDeltaRuleFunction / ChunkKDAFunction forward, keeping the fp32 chunk
    states they drop."""
    q_rstd = k_rstd = None
    if l2:
        q, q_rstd = fla.l2norm_fwd(q)
        k, k_rstd = fla.l2norm_fwd(k)
    cu = wave.cu_seqlens
    idx = fla.prepare_chunk_indices(cu, BT, cu_seqlens_cpu=wave.cu_seqlens_cpu)
    common = {"cu_seqlens": cu, "chunk_indices": idx, "chunk_size": BT}
    gc = fla.chunk_local_cumsum(
        g, chunk_size=BT, scale=fla.RCP_LN2.get(), cu_seqlens=cu, chunk_indices=idx
    )  # [1, T, H(, K)] log2, fp32
    if g.dim() == 4:
        w, u, _, kg, Aqk, Akk = fla.chunk_kda_fwd_intra(q=q, k=k, v=v, gk=gc, beta=beta, scale=scale, **common)
        h, v_new, ht = STATE_KERNELS["fwd_h"](kg, w, u, gc, h0, True, cu, idx, BT)  # h [1, NT, H, K, V] fp32
        o = fla.chunk_gla_fwd_o_gk(q=q, v=v_new, g=gc, A=Aqk, h=h.to(k.dtype), scale=scale, **common)
        A = (Aqk, Akk)
    else:
        w, u, Akk = fla.chunk_gated_delta_rule_fwd_intra(k=k, v=v, g=gc, beta=beta, **common)
        h, v_new, ht = STATE_KERNELS["fwd_h"](k, w, u, gc, h0, True, cu, idx, BT)
        o = fla.chunk_fwd_o(q=q, k=k, v=v_new, h=h.to(k.dtype), g=gc, scale=scale, **common)
        A = (Akk,)
    ctx.save_for_backward(q, q_rstd, k, k_rstd, v, gc, beta, h0, idx, *A)
    ctx.wave, ctx.scale, ctx.l2, ctx.g_dtype = wave, scale, l2, g.dtype
    return o.to(q.dtype), h[0], ht


def _backward(ctx, do: T | None, dh_ext: T | None, dht: T | None) -> tuple[T, T, T, T, T, T]:
    """fla's chunk_gated_delta_rule_bwd / chunk_kda_bwd with the dhu call replaced by
    ``delta_state_grad``, which also takes the children's gradients on interior chunk-start states."""
    from .delta_state_grad import delta_state_grad  # imports triton

    q, q_rstd, k, k_rstd, v, gc, beta, h0, idx, *A = ctx.saved_tensors
    wave, scale = ctx.wave, ctx.scale
    cu = wave.cu_seqlens
    common = {"cu_seqlens": cu, "chunk_indices": idx}
    do = torch.zeros_like(v) if do is None else do  # only states were differentiated
    dht = torch.zeros_like(h0) if dht is None else dht
    kda = gc.dim() == 4

    def state_grads(w: T, dv: T) -> tuple[T, T, T]:
        """(dh [1, NT, H, K, V], dv2 [1, T, H, V]) in the dtypes fla's dhu hands on, dh0 fp32."""
        dh, dv2, dh0 = delta_state_grad(
            q[0], k[0], w[0], gc[0] * math.log(2), do[0], dv[0], dht, dh_ext, cu, scale=scale, chunk_size=BT
        )
        return dh[None].to(q.dtype), dv2[None].to(dv.dtype), dh0

    if kda:
        Aqk, Akk = A
        w, u, _, kg = fla.kda_recompute_w_u_fwd(q=q, k=k, v=v, beta=beta, A=Akk, gk=gc, **common)
        h, v_new, _ = STATE_KERNELS["fwd_h"](kg, w, u, gc, h0, False, cu, idx, BT)
        dAqk, dv = fla.chunk_kda_bwd_dAv(q=q, k=k, v=v_new, do=do, A=Aqk, scale=scale, chunk_size=BT, **common)
        dh, dv2, dh0 = state_grads(w, dv)
        dq, dk, dv, db, dg, dAkk = fla.chunk_kda_bwd_wy_dqkg_fused(
            q=q,
            k=k,
            v=v,
            v_new=v_new,
            g=gc,
            beta=beta,
            A=Akk,
            h=h.to(k.dtype),
            do=do,
            dh=dh,
            dv=dv2,
            scale=scale,
            chunk_size=BT,
            **common,
        )
        dq, dk, db, dg = fla.chunk_kda_bwd_intra(
            q=q, k=k, g=gc, beta=beta, dAqk=dAqk, dAkk=dAkk, dq=dq, dk=dk, db=db, dg=dg, chunk_size=BT, **common
        )
    else:
        (Akk,) = A
        w, u = fla.recompute_w_u_fwd(k=k, v=v, beta=beta, A=Akk, g=gc, **common)
        h, v_new, _ = STATE_KERNELS["fwd_h"](k, w, u, gc, h0, False, cu, idx, BT)
        dv = fla.chunk_bwd_dv_local(q=q, k=k, g=gc, do=do, scale=scale, chunk_size=BT, **common)
        dh, dv2, dh0 = state_grads(w, dv)
        dq, dk, dw, dg = fla.chunk_bwd_dqkwg(
            q=q, k=k, v=v_new, w=w, g=gc, h=h.to(k.dtype), dv=dv2, do=do, dh=dh, scale=scale, chunk_size=BT, **common
        )
        dk2, dv, db, dg2 = fla.prepare_wy_repr_bwd(k=k, v=v, beta=beta, g=gc, A=Akk, dw=dw, du=dv2, **common)
        dk.add_(dk2)
        dg.add_(dg2)
    dg = fla.chunk_local_cumsum(dg, chunk_size=BT, reverse=True, **common)
    if ctx.l2:
        dq = fla.l2norm_bwd(q, q_rstd, dq)
        dk = fla.l2norm_bwd(k, k_rstd, dk)
    return dq.to(q), dk.to(k), dv.to(v), dg.to(ctx.g_dtype), db.to(beta), dh0


@dataclass(frozen=True)
class DeltaChunkOp:
    """GDN (g [1, T, H]) or KDA (g [1, T, H, K]), beta [1, T, H], as a segment kernel of the
    ``cut=False`` layout (``driver.py`` signature): also returns the start state of each of fla's
    64-token chunks, h_chunks [NT, H, K, V] fp32, differentiable; ``l2``: fla's in-kernel q/k
    l2norm."""

    def __call__(
        self, q: T, k: T, v: T, g: T, beta: T | None, h0: T, wave: Wave, *, scale: float, chunks: bool, l2: bool = False
    ) -> tuple[T, T | None, T]:
        o, h, ht = fla_chunks(_forward, _backward, q, k, v, g, beta, h0, wave, scale, l2)
        return o, h if chunks else None, ht

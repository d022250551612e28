"""Our Triton kernel for the delta-rule state-gradient recurrence with gradients injected at
interior chunk boundaries (GDN: per-head decay; KDA: per-channel decay).

A child path that starts mid-parent reads the parent's state at an interior chunk boundary, so
the parent's backward must add that state's gradient before propagating further back; fla's own
kernel takes a gradient only at a sequence's end (``dht``). Per sequence, in reverse chunk order
(c = NT-1 .. 0), with h_c the state at the start of chunk c, G_c the chunk's total log-decay and
g_t the chunk-local cumulative log-decay::

    b = dht                                   # grad of the state after the last chunk
    for c = NT-1 .. 0:
        b += dh_ext[c + 1]   (if c + 1 < NT)  # gradient a child / the caller put on h_{c+1}
        dh[c] = b                             # grad of h_{c+1}, the state after chunk c
        dv2_c = dv_c + (k_c * exp(G_c - g))  @ b
        b = exp(G_c) * b + scale * (q_c * exp(g))^T @ do_c - w_c^T @ dv2_c
    dh0 = b + dh_ext[0]

from the forward ``v_new = u - w h_c``, ``h_{c+1} = exp(G_c) h_c + (k exp(G_c - g))^T v_new``,
``o = scale (q exp(g)) h_c + intra``. ``dh``/``dv2``/``dh0`` are what fla's ``chunk_bwd_dqkwg`` and
``prepare_wy_repr_bwd`` consume. Written from that math, not from fla's kernel; it avoids the
two constructs Triton's interpreter cannot run, so CI tests it on CPU.

Legend: T tokens (varlen, batch 1), N sequences, NT chunks (all sequences), H heads, K key dim,
V value dim, BT chunk size, BV value block.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ...chunking import CHUNK_SIZE

__all__ = ["delta_state_grad"]

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# One config under the interpreter (it has no benchmarking driver); a few on a GPU.
_CONFIGS = (
    [triton.Config({"BV": 32}, num_warps=4)]
    if _INTERPRET
    else [triton.Config({"BV": bv}, num_warps=w, num_stages=s) for bv in (32, 64) for w in (2, 4) for s in (2, 3)]
)


@triton.autotune(configs=_CONFIGS, key=["H", "K", "V", "BT", "PER_CHANNEL"])
@triton.jit
def _delta_state_grad_kernel(
    q,
    k,
    w,
    g,
    do,
    dv,
    dht,
    dh_ext,
    dh,
    dv2,
    dh0,
    cu_seqlens,
    chunk_offsets,
    scale,
    total_chunks,
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BV: tl.constexpr,
    PER_CHANNEL: tl.constexpr,
    HAS_EXT: tl.constexpr,
):
    i_v = tl.program_id(0)
    i_nh = tl.program_id(1)
    i_n = i_nh // H
    i_h = i_nh % H
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    first = tl.load(chunk_offsets + i_n).to(tl.int64)
    num_chunks = (eos - bos + BT - 1) // BT

    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    o_t = tl.arange(0, BT)
    state = (i_h * K + o_k[:, None]) * V + o_v[None, :]  # [K, BV] offsets in an [.., H, K, V] row
    m_state = m_v[None, :] & (o_k[:, None] < K)

    b_dh = tl.load(dht + i_n * H * K * V + state, mask=m_state, other=0.0).to(tl.float32)
    for j in range(num_chunks):
        c = num_chunks - 1 - j
        row = first + c  # this chunk's row of dh / dh_ext
        if HAS_EXT:
            # The end state's gradient is dht: only interior boundaries take dh_ext (a 0/1 factor,
            # not a scalar-and-tensor mask, which the interpreter refuses).
            inner = tl.where(c + 1 < num_chunks, 1.0, 0.0)
            nxt = tl.minimum(row + 1, total_chunks - 1)
            b_dh += inner * tl.load(dh_ext + nxt * H * K * V + state, mask=m_state, other=0.0).to(tl.float32)
        tl.store(dh + row * H * K * V + state, b_dh.to(dh.dtype.element_ty), mask=m_state)

        t = bos + c * BT + o_t  # [BT]
        m_t = t < eos
        last = tl.minimum(bos + c * BT + BT, eos) - 1
        if PER_CHANNEL:
            b_g = tl.load(g + (t[:, None] * H + i_h) * K + o_k[None, :], mask=m_t[:, None], other=0.0).to(tl.float32)
            b_glast = tl.load(g + (last * H + i_h) * K + o_k).to(tl.float32)  # [K]
            k_decay = tl.exp(b_glast[None, :] - b_g)  # [BT, K]
            q_decay = tl.exp(b_g)
            chunk_decay = tl.exp(b_glast)[:, None]  # [K, 1]
        else:
            b_g = tl.load(g + t * H + i_h, mask=m_t, other=0.0).to(tl.float32)
            b_glast = tl.load(g + last * H + i_h).to(tl.float32)
            k_decay = tl.exp(b_glast - b_g)[:, None]  # [BT, 1]
            q_decay = tl.exp(b_g)[:, None]
            chunk_decay = tl.exp(b_glast)

        tok_k = (t[:, None] * H + i_h) * K + o_k[None, :]  # [BT, K]
        tok_v = (t[:, None] * H + i_h) * V + o_v[None, :]  # [BT, BV]
        m_tk = m_t[:, None] & (o_k[None, :] < K)
        m_tv = m_t[:, None] & m_v[None, :]
        b_k = tl.load(k + tok_k, mask=m_tk, other=0.0).to(tl.float32) * k_decay
        b_q = tl.load(q + tok_k, mask=m_tk, other=0.0).to(tl.float32) * q_decay * scale
        b_w = tl.load(w + tok_k, mask=m_tk, other=0.0).to(tl.float32)
        b_do = tl.load(do + tok_v, mask=m_tv, other=0.0).to(tl.float32)
        b_dv = tl.load(dv + tok_v, mask=m_tv, other=0.0).to(tl.float32) + tl.dot(b_k, b_dh)  # [BT, BV]
        tl.store(dv2 + tok_v, b_dv.to(dv2.dtype.element_ty), mask=m_tv)
        b_dh = chunk_decay * b_dh + tl.dot(tl.trans(b_q), b_do) - tl.dot(tl.trans(b_w), b_dv)

    if HAS_EXT:
        b_dh += tl.load(dh_ext + first * H * K * V + state, mask=m_state, other=0.0).to(tl.float32)
    tl.store(dh0 + i_n * H * K * V + state, b_dh.to(dh0.dtype.element_ty), mask=m_state)


def delta_state_grad(
    q: torch.Tensor,
    k: torch.Tensor,
    w: torch.Tensor,
    g: torch.Tensor,
    do: torch.Tensor,
    dv: torch.Tensor,
    dht: torch.Tensor,
    dh_ext: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    *,
    scale: float,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The recurrence of the module docstring for every sequence of a varlen batch.

    q, k, w [T, H, K]; g [T, H] or [T, H, K] chunk-local cumulative natural-log decay; do, dv
    [T, H, V]; dht [N, H, K, V]; dh_ext [NT, H, K, V] gradient on each chunk's start state (None:
    none); cu_seqlens [N + 1] int. Returns dh [NT, H, K, V] fp32 (grad of each chunk's end
    state), dv2 [T, H, V] fp32, dh0 [N, H, K, V] fp32.
    """
    T, H, K = k.shape
    V = do.shape[-1]
    if K & (K - 1):
        raise ValueError(f"key dim {K} must be a power of two")
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    chunk_offsets = torch.cat((lengths.new_zeros(1), (-(-lengths // chunk_size)).cumsum(0)))
    num_chunks = int(chunk_offsets[-1])
    N = lengths.numel()
    dh = q.new_empty(num_chunks, H, K, V, dtype=torch.float32)
    dv2 = q.new_empty(T, H, V, dtype=torch.float32)
    dh0 = q.new_empty(N, H, K, V, dtype=torch.float32)
    grid = lambda meta: (triton.cdiv(V, meta["BV"]), N * H)
    _delta_state_grad_kernel[grid](
        q,
        k,
        w,
        g,
        do,
        dv,
        dht,
        dh if dh_ext is None else dh_ext,
        dh,
        dv2,
        dh0,
        cu_seqlens,
        chunk_offsets,
        scale,
        num_chunks,
        H=H,
        K=K,
        V=V,
        BT=chunk_size,
        PER_CHANNEL=g.dim() == 3,
        HAS_EXT=dh_ext is not None,
    )
    return dh, dv2, dh0

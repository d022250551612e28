"""PyTorch references for fla's two state kernels, ``chunk_fwd_h`` and ``chunk_bwd_dh``
(fla/ops/common/chunk_h.py), which Triton's interpreter cannot run: the CPU tests put them in
``harts_hf.ops.fla.diagonal.STATE_KERNELS`` and run every other fla piece for real.

Written from the recurrence, with fla's conventions: batch 1 varlen (``cu_seqlens``), chunking
restarting at every sequence start, gates ``g`` [1, T, H] or ``gk`` [1, T, H, K] as chunk-local
cumulative sums in log2 units; h row r = the state at the START of chunk r, dh row r = the
gradient of the state at its END (from ``do`` and ``dht`` only)::

    h_{c+1} = 2^{G_c} h_c + (k_c * 2^{G_c - g})^T v_c,    G_c = g at chunk c's last token
    dh_{c-1} = 2^{G_c} dh_c + scale * (q_c * 2^g)^T do_c,  dh of the last chunk = dht
"""

from __future__ import annotations

from itertools import pairwise

import torch

T = torch.Tensor


def _chunks(cu_seqlens: T, chunk: int) -> list[list[slice]]:
    """Token slices of every chunk of every sequence."""
    return [[slice(s, min(s + chunk, b)) for s in range(a, b, chunk)] for a, b in pairwise(cu_seqlens.tolist())]


def _log_decay(g: T | None, gk: T | None) -> T:
    """[T, H, K or 1] cumulative log2 gates, per key channel or broadcast over it."""
    return gk[0].float() if gk is not None else g[0].float()[..., None]


def chunk_fwd_h(
    k: T,
    v: T,
    h0: T | None,
    output_final_state: bool,
    cu_seqlens: T,
    chunk_size: int,
    states_in_fp32: bool,
    g: T | None = None,
    gk: T | None = None,
) -> tuple[T, T | None]:
    """(h [1, NT, H, K, V], ht [S, H, K, V] fp32 or None) as fla's ``chunk_fwd_h``."""
    lg, k, v = _log_decay(g, gk), k[0].float(), v[0].float()
    H, K, V = k.shape[1], k.shape[2], v.shape[2]
    rows, finals = [], []
    for n, chunks in enumerate(_chunks(cu_seqlens, chunk_size)):
        h = h0[n].float() if h0 is not None else k.new_zeros(H, K, V)
        for sl in chunks:
            rows.append(h)
            last = lg[sl][-1]  # [H, K or 1]
            h = h * last.exp2()[..., None] + torch.einsum("thk,thv->hkv", k[sl] * (last - lg[sl]).exp2(), v[sl])
        finals.append(h)
    out = torch.stack(rows)[None].to(torch.float32 if states_in_fp32 else k.dtype)
    return out, torch.stack(finals) if output_final_state else None


def chunk_bwd_dh(
    q: T,
    k: T,
    v: T,
    do: T,
    h0: T | None,
    dht: T | None,
    scale: float,
    cu_seqlens: T,
    chunk_size: int,
    states_in_fp32: bool,
    g: T | None = None,
    gk: T | None = None,
) -> tuple[T, T | None]:
    """(dh [1, NT, H, K, V], dh0 [S, H, K, V] fp32 or None) as fla's ``chunk_bwd_dh``."""
    lg, q, do = _log_decay(g, gk), q[0].float(), do[0].float()
    H, K, V = q.shape[1], q.shape[2], do.shape[2]
    rows, starts = [], []
    for n, chunks in enumerate(_chunks(cu_seqlens, chunk_size)):
        b = dht[n].float() if dht is not None else q.new_zeros(H, K, V)
        ends = []
        for sl in reversed(chunks):
            ends.append(b)
            b = b * lg[sl][-1].exp2()[..., None] + torch.einsum("thk,thv->hkv", q[sl] * scale * lg[sl].exp2(), do[sl])
        rows += ends[::-1]
        starts.append(b)
    out = torch.stack(rows)[None].to(torch.float32 if states_in_fp32 else k.dtype)
    return out, torch.stack(starts) if h0 is not None else None
